"""Section pool_alloc: alloc+free latency of a region against torch.empty and glibc malloc/free.

The same size sequence and the same pattern run through every allocator: windows of live blocks
are allocated, then freed in a shuffled order (tensors of a training step die out of order). Sizes
mimic a step's tensors, skewed small: most are biases, norms and small activations, a few are
large activation/gradient buffers. Memory is not touched, so this is the allocator's own cost, not
page faults. Each figure is the best of several passes (the least disturbed by the other processes
on a shared machine), divided by the number of alloc+free pairs.

Every figure includes one Python-to-C call per alloc and per free (pybind11, torch or ctypes); the
rows report the cost of an empty ctypes call and of the Python harness itself, so the difference
between allocators can be read beside the call overhead.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import random
import time

from colo.sizes import round_up

from .measure import pool_unavailable_reason, ratio, rows_per_device

SECTION = "pool_alloc"

# (share of requests, smallest, largest) bytes; log-uniform inside each class.
SIZE_CLASSES = ((0.70, 256, 64 << 10), (0.25, 64 << 10, 4 << 20), (0.05, 4 << 20, 32 << 20))


def size_mix(count: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    weights = [share for share, _, _ in SIZE_CLASSES]
    sizes = []
    for _ in range(count):
        _, lo, hi = rng.choices(SIZE_CLASSES, weights)[0]
        n = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        sizes.append(round_up(n, 64))  # whole 64-byte multiples, like tensors of 4/8-byte elements
    return sizes


def make_plan(sizes: list[int], window: int, seed: int = 1) -> list[tuple[list[int], list[int]]]:
    """[(sizes allocated together, the order their blocks are freed), ...]."""
    rng = random.Random(seed)
    plan = []
    for start in range(0, len(sizes), window):
        chunk = sizes[start:start + window]
        order = list(range(len(chunk)))
        rng.shuffle(order)
        plan.append((chunk, order))
    return plan


def run_plan(alloc, free, plan) -> float:
    """Seconds to run the whole plan. `free(handle)` is called, then the handle is dropped, so tensors
    (whose free is the drop) and raw pointers (whose free is the call) go through the same loop."""
    start = time.perf_counter()
    for sizes, order in plan:
        live = [alloc(n) for n in sizes]
        for i in order:
            free(live[i])
            live[i] = None
    return time.perf_counter() - start


def best_per_op(alloc, free, plan, repeats: int, progress, desc: str) -> float:
    ops = sum(len(sizes) for sizes, _ in plan)
    run_plan(alloc, free, plan)  # warm-up: commit chunks, grow glibc's heap, fill torch's caches
    return min(run_plan(alloc, free, plan) for _ in progress(range(repeats), desc)) / ops


def _drop(_handle) -> None:
    """free() for tensors: the tensor is released when the harness drops its last reference."""


def libc_allocator():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    malloc, free, labs = libc.malloc, libc.free, libc.labs
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free.restype, free.argtypes = None, [ctypes.c_void_p]
    labs.restype, labs.argtypes = ctypes.c_long, [ctypes.c_long]
    return malloc, free, labs


def call_overheads(repeats: int = 5, calls: int = 20000) -> dict:
    """Per-call cost of an empty ctypes call (labs) and per-op cost of the harness with builtins."""
    _, _, labs = libc_allocator()
    zeros = [0] * calls

    def per_call(fn):
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            for z in zeros:
                fn(z)
            best = min(best, time.perf_counter() - start)
        return best / calls

    empty_plan = make_plan([256] * calls, 32)
    harness = min(run_plan(abs, abs, empty_plan) for _ in range(repeats)) / calls
    return {"ctypes_call_s": per_call(labs), "harness_per_op_s": harness}


def workload(quick: bool):
    """(ops, repeats, window, sizes, plan, budget): the same size sequence for every allocator."""
    ops, repeats, window = (2048, 5, 32) if quick else (16384, 9, 64)
    sizes = size_mix(ops)
    # Room for the largest possible window; the budget is virtual until chunks are committed.
    budget = 1 << math.ceil(math.log2(window * max(sizes) * 2))
    return ops, repeats, window, sizes, make_plan(sizes, window), budget


def cpu_rows(quick: bool, progress) -> list[dict]:
    import torch

    import colo

    ops, repeats, window, sizes, plan, budget = workload(quick)
    region = colo.Pool("cpu", capacity=budget).region("bench_alloc", budget=budget)
    malloc, libc_free, _ = libc_allocator()
    native = region._native  # the core's allocate/free without the tensor wrapping (same package)

    region_empty = best_per_op(lambda n: region.empty((n,), torch.uint8), _drop, plan, repeats, progress,
                               "Region.empty")
    torch_empty = best_per_op(lambda n: torch.empty((n,), dtype=torch.uint8), _drop, plan, repeats, progress,
                              "torch.empty")
    core = best_per_op(native.allocate, native.free, plan, repeats, progress, "core allocate/free")
    glibc = best_per_op(malloc, libc_free, plan, repeats, progress, "glibc malloc/free")
    stats = region.stats()

    common = {
        "section": SECTION, "device": "cpu", "ops": ops, "live_window": window, "repeats": repeats,
        "size_min_bytes": min(sizes), "size_median_bytes": sorted(sizes)[len(sizes) // 2],
        "size_max_bytes": max(sizes), "region_committed_bytes": stats["committed_bytes"],
        **call_overheads(),
    }
    python_call = "one Python call per alloc and per free on both sides"
    return [
        {**common, "case": "alloc+free size mix: Region.empty", "colo_s": region_empty,
         "baseline": "torch.empty (CPU)", "baseline_s": torch_empty, "ratio": ratio(torch_empty, region_empty),
         "note": f"per op; tensor wrapping (DLPack) included; {python_call}"},
        {**common, "case": "alloc+free size mix: Region.empty", "colo_s": region_empty,
         "baseline": "glibc malloc/free (ctypes)", "baseline_s": glibc, "ratio": ratio(glibc, region_empty),
         "note": f"per op; the baseline returns a raw pointer, not a tensor; {python_call}"},
        {**common, "case": "alloc+free size mix: core allocate/free", "colo_s": core,
         "baseline": "glibc malloc/free (ctypes)", "baseline_s": glibc, "ratio": ratio(glibc, core),
         "note": f"per op; raw pointers on both sides (pybind11 vs ctypes); {python_call}"},
    ]


def cuda_rows(quick: bool, progress) -> list[dict]:
    import torch

    import colo

    ops, repeats, window, sizes, plan, budget = workload(quick)
    region = colo.Pool("cuda", capacity=budget).region("bench_alloc", budget=budget)
    # Neither side synchronises: both hand out device memory without waiting for the GPU.
    region_empty = best_per_op(lambda n: region.empty((n,), torch.uint8), _drop, plan, repeats, progress,
                               "Region.empty (cuda)")
    torch_empty = best_per_op(lambda n: torch.empty((n,), dtype=torch.uint8, device="cuda"), _drop, plan, repeats,
                              progress, "torch.empty (cuda)")
    return [{
        "section": SECTION, "device": "cuda", "case": "alloc+free size mix: Region.empty", "colo_s": region_empty,
        "baseline": "torch.empty (CUDA caching allocator)", "baseline_s": torch_empty,
        "ratio": ratio(torch_empty, region_empty), "ops": ops, "live_window": window, "repeats": repeats,
        "gpu": torch.cuda.get_device_name(), "note": "per op; no synchronisation on either side",
    }]


def run(quick: bool, progress, devices=("cpu", "cuda")) -> list[dict]:
    rows_of = {"cpu": cpu_rows, "cuda": cuda_rows}
    return rows_per_device(SECTION, "alloc+free size mix: Region.empty", devices, pool_unavailable_reason,
                           lambda device: rows_of[device](quick, progress))
