"""The dtype of the one copy of the weights that makes a whole GRPO step fastest on a device.

Generation and training both read the one copy, so its dtype has to be fast for both:

- CUDA: bf16 where the GPU has it (Ampere and later), else fp32 (colo does not train in fp16).
- x86 CPU with AMX (and oneDNN allowed to use it): bf16.
- x86 CPU with AVX512_BF16 but no AMX: whichever of the two a 512x512 matmul and its backward run
  faster in on one core, timed once per process (about 50 ms). The instructions alone do not say: an
  AMD Zen 5 trains and generates faster in bf16, while an Intel Xeon whose AMX its VM hides runs bf16
  matmuls at half its fp32 rate, and a whole colo.grpo step there is faster in fp32 (the bench's
  grpo_step rows, which measure both dtypes on the machine that runs them).
- x86 CPU without bf16 instructions: fp32. Torch emulates bf16 matmuls there: about 25x longer than
  fp32 on an AVX2 EPYC (torch 2.13), and vLLM's bf16 generation about 2x slower than its fp32 one.
- ARM CPU: bf16 where torch reports the bf16 extension, else fp32.

The CPU's instructions are read from what torch reports (`torch.cpu.get_capabilities()`, the
capability torch dispatches its own kernels at) and ONEDNN_MAX_CPU_ISA, so bf16 is only ever chosen
where vLLM loads its bf16 build (vLLM reads the same capabilities). The choice is made before any
engine starts; the ranks of a colo.grpo job take rank 0's (GRPOConfig.resolve_dtype), since a timing
may come out differently on each.
"""
from __future__ import annotations

import functools
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
    timed: bool = False  # the choice rests on measured_bf16_slowdown(), which the reason gives

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
    if "amx_bf16" in bf16_units:
        return DtypeChoice(torch.bfloat16, f"this CPU has {' and '.join(bf16_units).upper()} ({seen}): torch trains "
                                           "and vLLM serves bf16 natively")
    slowdown = measured_bf16_slowdown()
    timed = f"a bf16 matmul and its backward took {slowdown:.2f}x fp32's time on one core here"
    if slowdown < 1:
        return DtypeChoice(torch.bfloat16, f"this CPU has AVX512_BF16 ({seen}) and {timed}: torch trains and vLLM "
                                           "serves bf16 natively", timed=True)
    return DtypeChoice(torch.float32, f"this CPU has AVX512_BF16 but no AMX ({seen}), and {timed}: fp32 is faster",
                       timed=True)


@functools.cache
def measured_bf16_slowdown() -> float:
    """bf16_slowdown(512), timed once per process: what the CPU choice and colo.trl's warning go by."""
    return bf16_slowdown(512)


def bf16_slowdown(size: int = 256, repeats: int = 3) -> float:
    """How many times longer a size x size matmul and its backward take in bf16 than in fp32 on one core
    of this CPU (the best of `repeats` each; at 512 about 50 ms with bf16 instructions, under a second
    where bf16 is emulated). One thread: the per-core cost, steadier than a figure that depends on what
    else runs on the other cores."""
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

