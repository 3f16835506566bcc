"""What vLLM's CPU GEMM dispatch does on this machine's vLLM build, asked of the build itself: the
tests' side of colo.vllm_compat.forced_kernels.forced_cpu_gemm (which colo.bench uses too)."""
from __future__ import annotations

import torch


def onednn_takes(dtype: torch.dtype) -> bool:
    """Whether this machine's vLLM build makes oneDNN linears for weights of `dtype`, asked of the
    build itself: vLLM tries to create the oneDNN handle and falls back to F.linear when that fails
    (bf16 on CPUs without bf16 instructions, in its AVX2 build)."""
    import vllm._custom_ops as ops
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    if not ops._supports_onednn:
        return False
    try:
        ops.create_onednn_mm(torch.zeros(64, 64, dtype=dtype), 1)  # released when dropped
    except RuntimeError:
        return False
    return True


def forced_kernel_outcome(kernel: str, dtype: torch.dtype) -> str:
    """The kernel vLLM ends up using for a layer while `forced_cpu_gemm(kernel)` is in force: sgl
    takes only 16-bit weights, and where oneDNN refuses the dtype vLLM falls back to F.linear."""
    if kernel == "sgl" and dtype in (torch.bfloat16, torch.float16):
        return "sgl"
    if kernel in ("sgl", "onednn") and onednn_takes(dtype):
        return "onednn"
    return "plain"
