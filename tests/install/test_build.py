"""The package imports, build_info tells the truth, and build failures read clearly."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import colo
from helpers.cmake_driver import load_cmake_build

ROOT = Path(__file__).resolve().parents[2]


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


# --- whether the CUDA backend is required, and where cuda.h comes from (buildtools/cmake_build.py) ---

def _write_cuda_h(include_dir: Path, cuda_version_number: int) -> Path:
    include_dir.mkdir(parents=True)
    (include_dir / "cuda.h").write_text(f"#pragma once\n#define CUDA_VERSION {cuda_version_number}\n"
                                        "typedef int CUresult;\n")
    return include_dir


def test_a_cuda_torch_requires_the_cuda_backend_with_the_wheel_headers_of_its_cuda(tmp_path):
    cmake_build = load_cmake_build()
    cu13, cu12 = tmp_path / "nvidia/cu13/include", tmp_path / "nvidia/cuda_runtime/include"
    headers = {cu13: "13.0", cu12: "12.6"}
    plan = cmake_build.cuda_build_plan("12.6", None, headers)
    assert plan.build and plan.required_by == "this Python's torch is a CUDA 12.6 build"
    assert plan.include_dir == cu12  # torch's major, though listed second
    assert cmake_build.cuda_build_plan("13.0", "auto", headers).include_dir == cu13
    assert cmake_build.cuda_build_plan("12.4", "", {cu13: "13.0"}).include_dir == cu13  # any cuda.h serves
    assert plan.cmake_args() == ["-DCOLO_WITH_CUDA=ON", "-DCOLO_REQUIRE_CUDA=ON",
                                 "-DCOLO_CUDA_REQUIRED_BY=this Python's torch is a CUDA 12.6 build",
                                 f"-DCOLO_CUDA_INCLUDE_DIR={cu12}"]
    no_headers = cmake_build.cuda_build_plan("12.6", None, {})
    assert no_headers.required_by and no_headers.include_dir is None  # CMake then needs a toolkit or fails


def test_colo_cuda_overrides_torch_either_way(tmp_path):
    cmake_build = load_cmake_build()
    headers = {tmp_path / "nvidia/cu13/include": "13.0"}
    for off in ("0", "off", "No", "false"):
        plan = cmake_build.cuda_build_plan("12.6", off, headers)
        assert not plan.build and not plan.required_by and plan.include_dir is None, off
        assert plan.cmake_args()[:2] == ["-DCOLO_WITH_CUDA=OFF", "-DCOLO_REQUIRE_CUDA=OFF"]
    required = cmake_build.cuda_build_plan(None, "1", headers)
    assert required.build and required.required_by == "COLO_CUDA=1"
    assert required.include_dir == tmp_path / "nvidia/cu13/include"
    with pytest.raises(ValueError, match=r"COLO_CUDA='maybe' is not understood.*0 \(host backend only\)"):
        cmake_build.cuda_build_plan("12.6", "maybe", headers)


def test_a_cpu_torch_leaves_the_cuda_backend_to_a_toolkit_as_before(tmp_path):
    cmake_build = load_cmake_build()
    # torch_cuda None: a CPU torch, or no torch at all. Wheel headers are not used then, so a CPU
    # machine with Triton's cuda.h still builds host-only unless a toolkit is installed.
    plan = cmake_build.cuda_build_plan(None, None, {tmp_path / "triton/include": "13.1"})
    assert plan.build and plan.required_by == "" and plan.include_dir is None
    assert plan.cmake_args() == ["-DCOLO_WITH_CUDA=ON", "-DCOLO_REQUIRE_CUDA=OFF",
                                 "-DCOLO_CUDA_REQUIRED_BY=", "-DCOLO_CUDA_INCLUDE_DIR="]


def test_torch_and_the_nvidia_wheel_headers_are_found_in_site_packages_without_importing_torch(tmp_path):
    cmake_build = load_cmake_build()
    site = tmp_path / "site-packages"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "version.py").write_text(
        "from typing import Optional\n\n__version__ = '2.13.0+cu126'\ndebug = False\n"
        "cuda: Optional[str] = '12.6'\nhip: Optional[str] = None\n")
    triton = _write_cuda_h(site / "triton/backends/nvidia/include", 13010)
    cu12 = _write_cuda_h(site / "nvidia/cuda_runtime/include", 12060)
    (site / "nvidia/cublas/include").mkdir(parents=True)  # an NVIDIA wheel without cuda.h
    torch = cmake_build.installed_torch([tmp_path / "empty", site])
    assert (torch.version, torch.cuda) == ("2.13.0+cu126", "12.6")
    assert cmake_build.installed_torch([tmp_path]) is None
    headers = cmake_build.wheel_cuda_headers([site])
    assert list(headers.items()) == [(cu12, "12.6"), (triton, "13.1")]  # NVIDIA's runtime wheel first
    (site / "torch" / "version.py").write_text("cuda = None\n")
    with pytest.raises(ValueError, match="sets no __version__"):
        cmake_build.installed_torch([site])


def _configure_core(cmake_build, build_dir: Path, plan) -> None:
    """Configure the real project without Python bindings, with CMake's CUDA toolkit search turned off,
    as on a machine that has torch's NVIDIA wheels and no toolkit."""
    cmake_build.configure(ROOT, build_dir, ["-DCOLO_BUILD_PYTHON=OFF", "-DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON",
                                            *plan.cmake_args()])


def test_configure_with_a_required_cuda_backend_and_no_cuda_h_fails_saying_why_and_how_to_fix(tmp_path):
    cmake_build = load_cmake_build()
    plan = cmake_build.cuda_build_plan("12.6", None, {})
    with pytest.raises(cmake_build.CMakeConfigureError) as info:
        _configure_core(cmake_build, tmp_path / "build", plan)
    message = " ".join(str(info.value).split())  # CMake wraps the message's lines
    assert "the CUDA backend is required (this Python's torch is a CUDA 12.6 build) but cuda.h was not found" in message
    assert "CUDAToolkit_ROOT" in message and "nvidia-cuda-runtime-cu12" in message
    assert "set COLO_CUDA=0 to build the host backend only" in message  # the last paragraph is kept too


def test_configure_takes_cuda_h_from_a_wheel_when_no_toolkit_is_found(tmp_path, capsys):
    cmake_build = load_cmake_build()
    include = _write_cuda_h(tmp_path / "nvidia/cuda_runtime/include", 12060)
    _configure_core(cmake_build, tmp_path / "build", cmake_build.cuda_build_plan("12.6", None, {include: "12.6"}))
    assert f"colo: CUDA backend enabled (cuda.h of CUDA 12.6 from {include}; no CUDA toolkit found)" in capsys.readouterr().out


def test_configure_without_torch_cuda_or_toolkit_builds_the_host_backend_only(tmp_path, capsys):
    cmake_build = load_cmake_build()
    _configure_core(cmake_build, tmp_path / "build", cmake_build.cuda_build_plan(None, None, {}))
    assert "colo: no CUDA toolkit found; building the host backend only" in capsys.readouterr().out
