"""Forcing vLLM's CPU GEMM kernel choice: for benchmark baselines (colo.bench) and tests only.

colo's own engine path never imports this module. `forced_cpu_gemm(kernel)` makes vLLM's CPU dispatch
pick one kernel for every layer it can take, so CI on one CPU kind covers what another kind's vLLM
does, and a benchmark can run a baseline that stock vLLM cannot (packed kernels cannot take new
weights in place). Tests' own helpers around it live in tests/helpers/cpu_gemm.py.
"""
from __future__ import annotations

import contextlib

import torch

CPU_GEMM_KERNELS = ("sgl", "onednn", "plain")


def sgl_unavailable_reason() -> str:
    """Why this machine's vLLM build cannot run the sgl kernels ('' when it can)."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    if not hasattr(torch.ops._C, "convert_weight_packed"):
        return ("this CPU has no AVX-512-BF16, so vLLM loaded its AVX2/AVX-512 build (vllm._C_AVX2 or "
                "_C_AVX512), which has no sgl kernels; they run on AVX-512-BF16 and AMX machines")
    return ""


def _sgl_accepts(n: int, k: int, dtype: torch.dtype) -> bool:
    """vLLM's own shape rule for the sgl kernels, without its AMX and 1 MiB conditions."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False  # vLLM never packs fp32 weights with sgl
    return n < 16 or (k % 32 == 0 and n % 16 == 0)


@contextlib.contextmanager
def forced_cpu_gemm(kernel: str):
    """While the block runs, vLLM's CPU dispatch (run once per layer when an engine loads) picks
    `kernel` ("sgl", "onednn" or "plain" = torch.nn.functional.linear) for every layer it can take,
    on any x86 machine, so CI on one CPU kind covers what another kind's vLLM does, and a benchmark
    can run a baseline that stock vLLM cannot (packed kernels cannot take new weights in place).

    vLLM picks sgl-kernel when `check_cpu_sgl_kernel(N, K, dtype)` (AMX, 16/8-bit weights up to
    1 MiB), else oneDNN when `vllm._custom_ops._supports_onednn`, else F.linear; both are looked up
    at call time. This replaces them for the block: tests and baselines only, colo's own engine
    path never calls it.
    """
    import vllm._custom_ops as ops
    import vllm.model_executor.layers.utils as layer_utils

    if kernel not in CPU_GEMM_KERNELS:
        raise ValueError(f"unknown CPU GEMM kernel {kernel!r} (expected one of {CPU_GEMM_KERNELS})")
    if kernel == "sgl" and sgl_unavailable_reason():
        raise RuntimeError(sgl_unavailable_reason())
    saved = layer_utils.check_cpu_sgl_kernel, ops._supports_onednn
    layer_utils.check_cpu_sgl_kernel = _sgl_accepts if kernel == "sgl" else (lambda n, k, dtype: False)
    ops._supports_onednn = saved[1] and kernel != "plain"
    try:
        yield
    finally:
        layer_utils.check_cpu_sgl_kernel, ops._supports_onednn = saved
