"""The repository's CMake driver (buildtools/cmake_build.py), loaded for tests that configure or
build something themselves; it finds cmake and ninja the way `pip install` does."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_cmake_build():
    spec = importlib.util.spec_from_file_location("colo_cmake_build", ROOT / "buildtools" / "cmake_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
