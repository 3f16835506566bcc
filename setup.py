"""Build colo's compiled core (`colo._C`) with CMake; everything else is plain Python (pyproject.toml)."""
import importlib.util
import os
import sys
from pathlib import Path

import pybind11
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("colo_cmake_build", ROOT / "buildtools" / "cmake_build.py")
cmake_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cmake_build)


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        # COLO_CUDA and this Python's torch decide whether the CUDA backend is required (a CUDA torch
        # requires it), and cuda.h may come from torch's NVIDIA runtime wheel when no toolkit is installed.
        cuda_plan = cmake_build.cuda_plan_for_this_python()
        args = [
            f"-DCMAKE_BUILD_TYPE={os.environ.get('COLO_BUILD_TYPE', 'Release')}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            *cuda_plan.cmake_args(),
        ]
        cmake_build.configure(ROOT, build_dir, args)
        cmake_build.build(build_dir, target="_C")


setup(ext_modules=[CMakeExtension("colo._C")], cmdclass={"build_ext": CMakeBuild})
