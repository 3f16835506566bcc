"""Section sleep_wake: how fast a region releases and regains its memory, and how much goes back to the OS.

A region is filled with ~1 GiB of 16 MiB tensors (256 MiB with --quick; figures are per GiB), every
page written. One cycle is sleep then wake; the rows give both, their sum per GiB, what the first
write to every page costs after wake (wake may leave pages to fault back in lazily, which moves cost
to the next phase rather than removing it), and the bytes the process gave back while asleep: its
RSS from /proc/self/statm before and after sleep, beside the region's own `resident_bytes`.

Baselines, measured in the same run on the same bytes:
- host copy round trip: what vLLM's level-1 sleep does for weights: each tensor is cloned to a host
  buffer and the original freed; on wake a fresh buffer is allocated and copied back.
- free and allocate again (offload=False only): drop the tensors and torch.empty new ones. It also
  discards contents, but the addresses change, so an engine holding those tensors would break.

The pool's goal on the CPU: sleep+wake of 1 GiB in under 50 ms with at least 95% of resident bytes
returned; each offload=False row reports whether it was met here, it is not asserted.
"""
from __future__ import annotations

import statistics

from colo.sizes import rss_bytes

from .measure import Stopwatch, pool_unavailable_reason, ratio, rows_per_device

SECTION = "sleep_wake"
TENSOR_BYTES = 16 << 20
PAGE_BYTES = 4096
GOAL_SECONDS_PER_GIB = 0.050
GOAL_RETURNED_FRACTION = 0.95


class Device:
    """What differs between host and CUDA: synchronisation and how freed memory is observed."""

    def __init__(self, name: str):
        import torch

        self.name, self.torch = name, torch

    def sync(self) -> None:
        if self.name == "cuda":
            self.torch.cuda.synchronize()

    def used_bytes(self) -> int:
        """Memory this process holds on the device: RSS on the host, used device memory on CUDA."""
        if self.name == "cuda":
            free, total = self.torch.cuda.mem_get_info()
            return total - free
        return rss_bytes()

    def stopwatch(self) -> Stopwatch:
        return Stopwatch(self.sync)

    def release_cached(self) -> None:
        """Give torch's cached free memory back to the driver, as unmapping does (CUDA; the host has no cache)."""
        if self.name == "cuda":
            self.torch.cuda.empty_cache()


def touch_every_page(tensors) -> None:
    """Read and write back one byte per page: faults every page in, keeps the contents."""
    for t in tensors:
        t.view(-1, PAGE_BYTES)[:, 0].add_(0)


def fill(tensors) -> None:
    for i, t in enumerate(tensors):
        t.fill_(i % 251 + 1)


def torch_tensors(dev: Device, count: int) -> list:
    """`count` tensors of TENSOR_BYTES from torch's own allocator on the device."""
    return [dev.torch.empty((TENSOR_BYTES,), dtype=dev.torch.uint8, device=dev.name) for _ in range(count)]


def filled_torch_tensors(dev: Device, count: int) -> list:
    """torch_tensors, every page written (and the writes done)."""
    tensors = torch_tensors(dev, count)
    fill(tensors)
    dev.sync()
    return tensors


def contents_intact(tensors) -> bool:
    return all(bool((t[::PAGE_BYTES] == i % 251 + 1).all()) for i, t in enumerate(tensors))


def median_of(samples: list[dict]) -> dict:
    return {key: statistics.median(s[key] for s in samples) for key in samples[0]}


def measure_colo(dev: Device, total_bytes: int, offload: bool, repeats: int, progress, host_backend: str) -> dict:
    import torch

    import colo

    pool = colo.Pool(dev.name, capacity=total_bytes + (64 << 20), **({"host_backend": host_backend}
                                                                     if dev.name == "cpu" else {}))
    region = pool.region("bench_sleep", budget=total_bytes + (64 << 20))
    tensors = [region.empty((TENSOR_BYTES,), torch.uint8) for _ in range(total_bytes // TENSOR_BYTES)]
    fill(tensors)
    dev.sync()
    addresses = [t.data_ptr() for t in tensors]
    samples, intact = [], True
    for _ in progress(range(repeats), f"colo {host_backend if dev.name == 'cpu' else 'cuda'} offload={offload}"):
        resident_before = region.stats()["resident_bytes"]
        used_before = dev.used_bytes()
        with dev.stopwatch() as sleep:
            region.sleep(offload=offload)
        resident_asleep = region.stats()["resident_bytes"]
        used_asleep = dev.used_bytes()
        with dev.stopwatch() as wake:
            region.wake()
        with dev.stopwatch() as touch:
            touch_every_page(tensors)
        if offload:
            intact &= contents_intact(tensors)
        samples.append({
            "sleep_s": sleep.seconds, "wake_s": wake.seconds, "first_touch_s": touch.seconds,
            "resident_before_bytes": resident_before, "resident_asleep_bytes": resident_asleep,
            "returned_bytes": used_before - used_asleep,
        })
    same_addresses = addresses == [t.data_ptr() for t in tensors]
    result = median_of(samples)
    result.update(tensors=len(tensors), addresses_stable=same_addresses, backend=pool.backend)
    if offload:
        result["contents_intact"] = intact
    del tensors, region, pool
    return result


def measure_host_copy(dev: Device, total_bytes: int, repeats: int, progress) -> dict:
    """vLLM level-1 for weights: per tensor, clone to a host buffer and free; then allocate and copy back."""
    import torch

    host_kwargs = {"pin_memory": True} if dev.name == "cuda" else {}
    tensors = filled_torch_tensors(dev, total_bytes // TENSOR_BYTES)
    samples = []
    for _ in progress(range(repeats), f"baseline host copy ({dev.name})"):
        used_before = dev.used_bytes()
        with dev.stopwatch() as sleep:
            backups = []
            for t in tensors:
                backup = torch.empty(t.shape, dtype=t.dtype, **host_kwargs)
                backup.copy_(t)  # a blocking copy per tensor, as vLLM's CuMemAllocator.sleep does
                backups.append(backup)
            tensors.clear()
            dev.release_cached()
        used_asleep = dev.used_bytes()
        with dev.stopwatch() as wake:
            for backup in backups:
                tensors.append(torch.empty(backup.shape, dtype=backup.dtype, device=dev.name).copy_(backup))
            backups.clear()
        samples.append({"sleep_s": sleep.seconds, "wake_s": wake.seconds,
                        "returned_bytes": used_before - used_asleep})
    del tensors
    return median_of(samples)


def measure_free_and_allocate(dev: Device, total_bytes: int, repeats: int, progress) -> dict:
    """Discard contents the plain torch way: drop the tensors, allocate new ones (new addresses)."""
    count = total_bytes // TENSOR_BYTES
    tensors = filled_torch_tensors(dev, count)
    samples = []
    for _ in progress(range(repeats), f"baseline free+allocate ({dev.name})"):
        used_before = dev.used_bytes()
        with dev.stopwatch() as sleep:
            tensors.clear()
            dev.release_cached()
        used_asleep = dev.used_bytes()
        with dev.stopwatch() as wake:
            tensors = torch_tensors(dev, count)
        with dev.stopwatch() as touch:
            touch_every_page(tensors)
        samples.append({"sleep_s": sleep.seconds, "wake_s": wake.seconds, "first_touch_s": touch.seconds,
                        "returned_bytes": used_before - used_asleep})
    del tensors
    return median_of(samples)


def make_row(dev: Device, total_bytes: int, offload: bool, colo: dict, baseline_name: str, baseline: dict) -> dict:
    gib = total_bytes / 2**30
    colo_s = colo["sleep_s"] + colo["wake_s"]
    baseline_s = baseline["sleep_s"] + baseline["wake_s"]
    resident = colo["resident_before_bytes"]
    row = {
        "section": SECTION, "device": dev.name,
        "case": f"sleep+wake offload={offload} ({colo['backend']})",
        "colo_s": colo_s, "baseline": baseline_name, "baseline_s": baseline_s, "ratio": ratio(baseline_s, colo_s),
        "region_bytes": total_bytes,
        "colo_per_gib_s": colo_s / gib,
        "sleep_s": colo["sleep_s"], "wake_s": colo["wake_s"], "first_touch_s": colo["first_touch_s"],
        "ratio_incl_first_touch": ratio(baseline_s + baseline.get("first_touch_s", 0.0),
                                        colo_s + colo["first_touch_s"]),
        "resident_before_bytes": resident, "resident_asleep_bytes": colo["resident_asleep_bytes"],
        "returned_bytes": colo["returned_bytes"],
        "returned_fraction": colo["returned_bytes"] / resident if resident else 0.0,
        "resident_returned_fraction": (resident - colo["resident_asleep_bytes"]) / resident if resident else 0.0,
        "baseline_sleep_s": baseline["sleep_s"], "baseline_wake_s": baseline["wake_s"],
        "baseline_returned_bytes": baseline["returned_bytes"],
        "baseline_returned_fraction": baseline["returned_bytes"] / total_bytes,
        "addresses_stable": colo["addresses_stable"],
    }
    if "first_touch_s" in baseline:
        row["baseline_first_touch_s"] = baseline["first_touch_s"]
    if offload:
        row["contents_intact"] = colo["contents_intact"]
        row["note"] = ("contents kept; on the host the offload copy is host memory too, so the process gives back "
                       "little net" if dev.name == "cpu" else "contents kept in pinned host memory")
    else:
        within_time = row["colo_per_gib_s"] < GOAL_SECONDS_PER_GIB
        within_bytes = row["returned_fraction"] >= GOAL_RETURNED_FRACTION
        row["goal"] = f"sleep+wake < {GOAL_SECONDS_PER_GIB * 1e3:.0f} ms/GiB, >= {GOAL_RETURNED_FRACTION:.0%} returned"
        row["goal_met"] = within_time and within_bytes
        row["note"] = ("contents discarded (KV cache); the host-copy baseline keeps them" if "copy" in baseline_name
                       else "contents discarded on both sides; the baseline's tensors get new addresses")
        if "copy" not in baseline_name and row["baseline_returned_fraction"] < GOAL_RETURNED_FRACTION:
            # glibc keeps freed blocks for reuse once its mmap threshold has grown, so "free" may release nothing.
            row["note"] += (f"; the baseline gave back only {row['baseline_returned_fraction']:.0%} of the bytes "
                            "to the OS, so its time is not that of a release")
    return row


def device_rows(dev: Device, quick: bool, progress) -> list[dict]:
    total_bytes = (256 << 20) if quick else (1 << 30)
    repeats = 2 if quick else 3
    # The memfd backend mirrors CUDA VMM most closely but releases far slower on these hosts
    # (shmem huge pages are off: csrc/host_backend.cpp has the measurements).
    backends = ["anon"] if quick or dev.name == "cuda" else ["anon", "memfd"]
    host_copy = measure_host_copy(dev, total_bytes, repeats, progress)
    free_alloc = measure_free_and_allocate(dev, total_bytes, repeats, progress)
    rows = []
    for backend in backends:
        discard = measure_colo(dev, total_bytes, False, repeats, progress, backend)
        rows.append(make_row(dev, total_bytes, False, discard, "host copy round trip (vLLM level 1)", host_copy))
        rows.append(make_row(dev, total_bytes, False, discard, "free + torch.empty again", free_alloc))
        keep = measure_colo(dev, total_bytes, True, repeats, progress, backend)
        rows.append(make_row(dev, total_bytes, True, keep, "host copy round trip (vLLM level 1)", host_copy))
    return rows


def run(quick: bool, progress, devices=("cpu", "cuda")) -> list[dict]:
    return rows_per_device(SECTION, "sleep+wake", devices, pool_unavailable_reason,
                           lambda device: device_rows(Device(device), quick, progress))
