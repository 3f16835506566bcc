"""Configure and build colo's C++ extension with CMake + Ninja.

Standalone (no import of colo) so setup.py can load it before the extension exists, and tests can
check that a failing configure step produces a readable message.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


class CMakeConfigureError(RuntimeError):
    """CMake could not configure the project; the message carries the part of its output that matters."""


class CMakeBuildError(RuntimeError):
    """The compiler or linker failed; the message carries the tail of the build output."""


_HINTS = (
    "colo needs: cmake >= 3.22, ninja, a C++17 compiler (g++ or clang++), Python headers, pybind11.\n"
    "The CUDA backend is optional: it is built when a CUDA toolkit (nvcc, cuda.h) is found; set COLO_CUDA=0 to skip it.\n"
    "Extra CMake arguments can be passed in the CMAKE_ARGS environment variable."
)


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
        if "CMake Error" in line or "error:" in line.lower():
            picked.extend(lines[i:i + 6])
    return "\n".join(picked[:60]) if picked else _tail(text)


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
