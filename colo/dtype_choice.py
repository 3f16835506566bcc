"""The dtype of the one copy of the weights that makes a whole GRPO step fastest on a device.

Generation and training both read the one copy, so its dtype has to be fast for both:

- CUDA: bf16 where the GPU has it (Ampere and later), else fp32 (colo does not train in fp16).
- x86 CPU: bf16 where the CPU has bf16 dot-product instructions (AVX512_BF16, or AMX) and oneDNN
  may use them; fp32 elsewhere. Without them torch emulates bf16 matmuls: a 512x512 matmul and
  its backward take about 25x longer in bf16 than in fp32 on an AVX2 EPYC (torch 2.13), a colo.grpo
  step at 0.36B parameters 273 s against 14-18 s, and vLLM's bf16 generation there is about 2x
  slower than its fp32 one. With them bf16 is the faster of the two (generation 1.8x on an AMX
  Xeon; the bench's `dtype` rows measure both on the machine that runs it).
- ARM CPU: bf16 where torch reports the bf16 extension, else fp32.

Everything is read from what torch reports (`torch.cpu.get_capabilities()`, the capability torch
dispatches its own kernels at) and from ONEDNN_MAX_CPU_ISA, so it decides before any engine starts
and agrees with the native build vLLM will load (vLLM reads the same capabilities).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}
# The dtype names colo takes from users (colo.trl's colo_engine_dtype, colo.grpo's --save-dtype).
BY_NAME = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}

# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) below AVX512_CORE_BF16: bf16 matmuls are emulated under them.
_ONEDNN_CAPS_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return NAMES[self.dtype]


def fastest_dtype(device: str | torch.device = "cpu") -> DtypeChoice:
    """bf16 or fp32 for the one copy of the weights on `device`, and why (one line, for logs and run.json)."""
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice(torch.bfloat16, f"{torch.cuda.get_device_name(device)} computes in bf16 natively")
        return DtypeChoice(torch.float32, f"{torch.cuda.get_device_name(device)} has no bf16: fp32")
    if device.type != "cpu":
        raise ValueError(f"colo runs on 'cpu' or 'cuda' devices, not {device.type!r}")
    return _cpu_choice()


def _cpu_choice() -> DtypeChoice:
    caps = torch.cpu.get_capabilities()
    dispatch = torch.backends.cpu.get_cpu_capability()
    if str(caps.get("architecture", "")).lower() in ("arm64", "aarch64"):
        if caps.get("bf16", False):
            return DtypeChoice(torch.bfloat16, "this ARM CPU has the bf16 extension")
        return DtypeChoice(torch.float32, "this ARM CPU has no bf16 extension: torch would emulate bf16 matmuls")
    bf16_units = [name for name in ("amx_bf16", "avx512_bf16") if caps.get(name, False)]
    onednn_cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    seen = f"torch dispatches at {dispatch}"
    if not bf16_units:
        return DtypeChoice(torch.float32, f"this CPU has no bf16 instructions (no AVX512_BF16 or AMX; {seen}), so "
                                          "torch and vLLM would emulate bf16 matmuls, many times slower than fp32")
    if onednn_cap in _ONEDNN_CAPS_WITHOUT_BF16:
        return DtypeChoice(torch.float32, f"ONEDNN_MAX_CPU_ISA={onednn_cap} keeps oneDNN from the CPU's "
                                          f"{'/'.join(bf16_units).upper()}: bf16 matmuls would be emulated")
    return DtypeChoice(torch.bfloat16, f"this CPU has {' and '.join(bf16_units).upper()} ({seen}): torch trains and "
                                       "vLLM serves bf16 natively")


def emulated_bf16(device: str | torch.device = "cpu") -> str | None:
    """Why bf16 matmuls would be emulated on `device` (one line), or None where it computes bf16 natively.
    What TRL's default bf16=True (autocast) costs on a CPU without bf16 instructions; measure it with
    bf16_slowdown()."""
    choice = fastest_dtype(device)
    return None if choice.dtype == torch.bfloat16 else choice.reason


def bf16_slowdown(size: int = 256, repeats: int = 3) -> float:
    """How many times longer a size x size matmul and its backward take in bf16 than in fp32 on one core
    of this CPU (the best of `repeats` each; under half a second where bf16 is emulated). One thread:
    the per-core cost, steadier than a figure that depends on what else runs on the other cores."""
    import time

    def best(dtype) -> float:
        a = torch.randn(size, size, dtype=dtype, requires_grad=True)
        b = torch.randn(size, size, dtype=dtype)
        times = []
        for _ in range(repeats + 1):  # the first call pays for kernel selection
            start = time.perf_counter()
            (a @ b).sum().backward()
            times.append(time.perf_counter() - start)
        return min(times[1:])

    threads = torch.get_num_threads()
    torch._C.set_num_threads(1)  # torch._C's: vLLM's CPU worker replaces torch.set_num_threads with a no-op
    try:
        return best(torch.bfloat16) / best(torch.float32)
    finally:
        torch._C.set_num_threads(threads)

