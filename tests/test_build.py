"""The package imports, build_info tells the truth, and build failures read clearly."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import colo
from build_helpers import load_cmake_build

ROOT = Path(__file__).resolve().parents[1]


def _linked_libraries() -> str:
    return subprocess.run(["ldd", colo._C.__file__], capture_output=True, text=True, check=True).stdout


def test_import_and_build_info_keys():
    info = colo.build_info()
    for key in ("backends", "cuda_compiled", "cuda_version", "cuda_available", "cuda_unavailable_reason"):
        assert key in info
    assert {"host-anon", "host-memfd"} <= set(info["backends"])
    assert ("cuda-vmm" in info["backends"]) == info["cuda_compiled"]
    assert (info["cuda_version"] != "") == info["cuda_compiled"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA toolkit on this machine")
def test_cuda_backend_compiled_against_the_installed_toolkit():
    info = colo.build_info()
    assert info["cuda_compiled"], "a CUDA toolkit is installed, so the CUDA backend must be built"
    release = re.search(r"release (\d+\.\d+)", subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout)
    assert info["cuda_version"].startswith(release.group(1))


def test_extension_links_neither_libcuda_nor_torch():
    libs = _linked_libraries()
    assert "libcuda" not in libs  # the driver is opened at run time
    assert "libtorch" not in libs and "libc10" not in libs  # tensors cross as DLPack


def test_cuda_availability_is_consistent_with_the_machine():
    has_driver = Path("/proc/driver/nvidia/version").exists()
    if not has_driver:
        assert not colo.cuda_available()
        reason = colo.cuda_unavailable_reason()
        assert reason and ("libcuda" in reason or "built without" in reason or "no CUDA device" in reason)
        with pytest.raises(ValueError, match="CUDA is unavailable"):
            colo.Pool("cuda")
    elif colo.build_info()["cuda_compiled"]:
        # A driver is present and the backend is built: CUDA must be usable, with no excuse given.
        assert colo.cuda_available(), colo.cuda_unavailable_reason()
        assert colo.cuda_unavailable_reason() == ""


def test_python_dash_m_colo_reports_the_build():
    out = subprocess.run([sys.executable, "-m", "colo"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert '"backends"' in out.stdout
    if not colo.cuda_available():
        assert "CUDA is unavailable" in out.stdout


def test_cmake_configure_failure_is_readable(tmp_path):
    cmake_build = load_cmake_build()
    source = tmp_path / "src"
    source.mkdir()
    (source / "CMakeLists.txt").write_text(
        'cmake_minimum_required(VERSION 3.22)\nproject(broken CXX)\nmessage(FATAL_ERROR "pybind11 was not found here")\n'
    )
    with pytest.raises(cmake_build.CMakeConfigureError) as info:
        cmake_build.configure(source, tmp_path / "build")
    message = str(info.value)
    assert "could not configure" in message
    assert "pybind11 was not found here" in message  # CMake's own words are kept
    assert "colo needs" in message  # and what to check


def test_cmake_configure_of_a_missing_source_dir_is_readable(tmp_path):
    cmake_build = load_cmake_build()
    with pytest.raises(cmake_build.CMakeConfigureError, match="could not configure"):
        cmake_build.configure(tmp_path / "nowhere", tmp_path / "build")
