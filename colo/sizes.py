"""Byte counts used across colo: of tensors and shapes, rounded to a unit, and of this process's memory."""
from __future__ import annotations

import math
import os

import torch

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def tensor_bytes(tensors) -> int:
    """Bytes of the elements of `tensors` together (views count their own elements, not their storage)."""
    return sum(t.nbytes for t in tensors)


def shape_bytes(shape, dtype: torch.dtype) -> int:
    """Bytes of a contiguous tensor of `shape` and `dtype`."""
    return math.prod(shape) * dtype.itemsize


def round_up(nbytes: int, unit: int) -> int:
    """The smallest multiple of `unit` that is at least `nbytes`."""
    return -(-nbytes // unit) * unit


def rss_bytes() -> int:
    """Resident set of this process, from /proc/self/statm (includes shared memfd pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE_BYTES


def device_memory_bytes(device) -> int:
    """All the memory of `device`: the GPU's, or the machine's for a CPU (what vLLM's memory fraction
    is a fraction of)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PHYS_PAGES") * _PAGE_BYTES
