"""Configure and build colo's C++ extension with CMake + Ninja.

Standalone (no import of colo) so setup.py can load it before the extension exists, and tests can
check that a failing configure step produces a readable message.
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import NamedTuple


class CMakeConfigureError(RuntimeError):
    """CMake could not configure the project; the message carries the part of its output that matters."""


class CMakeBuildError(RuntimeError):
    """The compiler or linker failed; the message carries the tail of the build output."""


_HINTS = (
    "colo needs: cmake >= 3.22, ninja, a C++17 compiler (g++ or clang++), Python headers, pybind11.\n"
    "The CUDA backend needs only cuda.h (from a CUDA toolkit, or from the NVIDIA CUDA runtime wheel torch\n"
    "installs). It is required when this Python's torch is a CUDA build or COLO_CUDA=1, and optional otherwise;\n"
    "set COLO_CUDA=0 to build the host backend only.\n"
    "Extra CMake arguments can be passed in the CMAKE_ARGS environment variable."
)


# --- the CUDA backend: whether it must be built, and where cuda.h comes from ---------------------

_COLO_CUDA_OFF = ("0", "off", "no", "false")
_COLO_CUDA_ON = ("1", "on", "yes", "true")
_COLO_CUDA_AUTO = ("", "auto")


# NamedTuples, not dataclasses: setup.py and the tests load this file without registering it in
# sys.modules, which dataclasses need.
class InstalledTorch(NamedTuple):
    version: str  # torch.__version__, e.g. "2.13.0+cu126"
    cuda: str | None  # torch.version.cuda, e.g. "12.6"; None for a CPU build


class CudaBuildPlan(NamedTuple):
    """What the CMake configure step is told about the CUDA backend."""

    build: bool  # try to build it (COLO_WITH_CUDA)
    required_by: str  # why configure must fail when no cuda.h is found; "" when the backend is optional
    include_dir: Path | None  # cuda.h from an installed NVIDIA wheel, used when CMake finds no CUDA toolkit

    def cmake_args(self) -> list[str]:
        # Every variable is passed every time: CMake caches them, and a stale one would outlive the plan.
        return [
            f"-DCOLO_WITH_CUDA={'ON' if self.build else 'OFF'}",
            f"-DCOLO_REQUIRE_CUDA={'ON' if self.required_by else 'OFF'}",
            f"-DCOLO_CUDA_REQUIRED_BY={self.required_by}",
            f"-DCOLO_CUDA_INCLUDE_DIR={self.include_dir or ''}",
        ]


def cuda_build_plan(torch_cuda: str | None, colo_cuda: str | None, wheel_headers: dict[Path, str]) -> CudaBuildPlan:
    """Decide how the CUDA backend is built.

    torch_cuda: torch.version.cuda of the Python that builds colo ("12.6"), None for a CPU torch or no torch.
    colo_cuda: the COLO_CUDA environment variable, None when unset.
    wheel_headers: include dirs of installed NVIDIA wheels that hold cuda.h, each with its CUDA version.
    """
    setting = (colo_cuda or "").strip().lower()
    if setting in _COLO_CUDA_OFF:
        return CudaBuildPlan(build=False, required_by="", include_dir=None)
    if setting in _COLO_CUDA_ON:
        required_by = f"COLO_CUDA={colo_cuda}"
    elif setting in _COLO_CUDA_AUTO:
        # A CUDA torch means a GPU machine: a host-only colo there would only fail later, at colo.Pool("cuda").
        required_by = f"this Python's torch is a CUDA {torch_cuda} build" if torch_cuda else ""
    else:
        raise ValueError(f"colo: COLO_CUDA={colo_cuda!r} is not understood; use 0 (host backend only), "
                         "1 (require the CUDA backend) or auto (required when torch is a CUDA build)")
    # Wheel headers only where the backend is required: elsewhere a CUDA toolkit decides, as it always did.
    include_dir = pick_wheel_headers(wheel_headers, torch_cuda) if required_by else None
    return CudaBuildPlan(build=True, required_by=required_by, include_dir=include_dir)


def pick_wheel_headers(wheel_headers: dict[Path, str], torch_cuda: str | None) -> Path | None:
    """The include dir whose CUDA major is torch's, else the first found (colo needs only the driver API
    types, which every recent cuda.h declares alike); None when there is none."""
    matching = [path for path, version in wheel_headers.items()
                if torch_cuda and _cuda_major(version) == _cuda_major(torch_cuda)]
    return (matching or list(wheel_headers) or [None])[0]


def _cuda_major(version: str) -> int:
    return int(version.split(".")[0])


def python_site_dirs() -> list[Path]:
    """Where this Python's packages are installed: its sysconfig dirs first (pip's isolated build
    environment drops them from sys.path, yet torch and its NVIDIA wheels are there), then sys.path."""
    paths = sysconfig.get_paths()
    found: list[Path] = []
    for entry in (paths["purelib"], paths["platlib"], *sys.path):
        path = Path(entry or ".").resolve()
        if path.is_dir() and path not in found:
            found.append(path)
    return found


def installed_torch(site_dirs: list[Path]) -> InstalledTorch | None:
    """The torch installed in the first of site_dirs that has one, read from torch/version.py."""
    for site in site_dirs:
        version_file = site / "torch" / "version.py"
        if version_file.is_file():
            return read_torch_version_file(version_file)
    return None


def read_torch_version_file(path: Path) -> InstalledTorch:
    """__version__ and cuda of a torch/version.py, read without importing torch (slow, and not
    importable from pip's isolated build environment)."""
    values = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        elif isinstance(node, ast.AnnAssign):
            target = node.target
        else:
            continue
        if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
            values[target.id] = node.value.value
    if "__version__" not in values:
        raise ValueError(f"colo: {path} sets no __version__; is this torch installation complete?")
    return InstalledTorch(version=str(values["__version__"]), cuda=values.get("cuda"))


def wheel_cuda_headers(site_dirs: list[Path]) -> dict[Path, str]:
    """Include dirs with cuda.h in installed wheels, each with the CUDA version the header declares.

    NVIDIA's runtime wheels first: nvidia/cu13/include (nvidia-cuda-runtime 13.x, which torch's CUDA 13
    build pulls in) and nvidia/cuda_runtime/include (nvidia-cuda-runtime-cu12); Triton's bundled copy
    last, as its version follows Triton's, not torch's.
    """
    headers = [header for site in site_dirs for header in sorted(site.glob("nvidia/*/include/cuda.h"))]
    headers += [site / "triton" / "backends" / "nvidia" / "include" / "cuda.h" for site in site_dirs]
    found: dict[Path, str] = {}
    for header in headers:
        version = cuda_header_version(header) if header.is_file() else None
        if version:
            found.setdefault(header.parent, version)
    return found


def cuda_header_version(header: Path) -> str | None:
    """The CUDA version a cuda.h declares ("#define CUDA_VERSION 12060" -> "12.6"), None if it declares none."""
    match = re.search(r"^#define CUDA_VERSION (\d+)", header.read_text(errors="replace"), re.MULTILINE)
    if not match:
        return None
    number = int(match.group(1))
    return f"{number // 1000}.{number % 1000 // 10}"


def cuda_plan_for_this_python(environ: dict[str, str] | None = None) -> CudaBuildPlan:
    """cuda_build_plan for the Python running this (setup.py's) and its environment variables."""
    environ = os.environ if environ is None else environ
    site_dirs = python_site_dirs()
    torch = installed_torch(site_dirs)
    return cuda_build_plan(torch.cuda if torch else None, environ.get("COLO_CUDA"), wheel_cuda_headers(site_dirs))


def _cmake_executable() -> str:
    try:  # the `cmake` PyPI package, present in pip's isolated build environment
        import cmake  # type: ignore

        candidate = Path(cmake.CMAKE_BIN_DIR) / "cmake"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("cmake")
    if not found:
        raise CMakeConfigureError("colo: cmake was not found on PATH.\n" + _HINTS)
    return found


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _error_lines(text: str) -> str:
    """The lines of CMake output that say what went wrong (CMake prefixes them with 'CMake Error')."""
    lines = text.splitlines()
    picked = []
    for i, line in enumerate(lines):
        if "CMake Error" in line:
            picked.extend(lines[i:max(i + 6, _message_end(lines, i))])
        elif "error:" in line.lower():
            picked.extend(lines[i:i + 6])
    return "\n".join(picked[:60]) if picked else _tail(text)


def _message_end(lines: list[str], start: int) -> int:
    """The index just past the CMake message that starts at lines[start]. CMake indents a message's
    lines, with blank lines between its paragraphs, and the fix is usually in the last paragraph."""
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith(" ")):
        end += 1
    while end > start + 1 and not lines[end - 1].strip():
        end -= 1
    return end


def configure(source_dir: str | os.PathLike, build_dir: str | os.PathLike, extra_args: list[str] | None = None) -> None:
    """Run the CMake configure step; raise CMakeConfigureError with a readable message on failure."""
    build_dir = Path(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    args = [_cmake_executable(), "-S", str(source_dir), "-B", str(build_dir), "-G", "Ninja"]
    ninja = shutil.which("ninja")
    try:
        import ninja as ninja_pkg  # type: ignore

        ninja = str(Path(ninja_pkg.BIN_DIR) / "ninja")
    except ImportError:
        pass
    if ninja:
        args.append(f"-DCMAKE_MAKE_PROGRAM={ninja}")
    args += extra_args or []
    args += [a for a in os.environ.get("CMAKE_ARGS", "").split() if a]
    proc = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise CMakeConfigureError(
            f"colo: CMake could not configure the C++ extension (exit code {proc.returncode}).\n"
            f"--- what CMake reported ---\n{_error_lines(proc.stdout)}\n---\n{_HINTS}\n"
            f"Command: {' '.join(args)}"
        )
    sys.stdout.write(_tail(proc.stdout, 15) + "\n")


def build(build_dir: str | os.PathLike, target: str | None = None, jobs: int | None = None) -> None:
    """Run the build step; raise CMakeBuildError with the tail of the compiler output on failure."""
    args = [_cmake_executable(), "--build", str(build_dir)]
    if target:
        args += ["--target", target]
    args += ["--parallel", str(jobs or os.cpu_count() or 2)]
    proc = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise CMakeBuildError(
            f"colo: building the C++ extension failed (exit code {proc.returncode}).\n"
            f"--- compiler output (tail) ---\n{_error_lines(proc.stdout)}\n---\n{_HINTS}"
        )
