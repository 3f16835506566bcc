"""Allocate torch tensors in a pool region while a block of code runs: `with AllocateIn(region_of): ...`.

torch's CPU allocator cannot be redirected, and on CUDA a MemPool hands colo whole segments sized by
torch's caching rules (a 2 MiB KV cache asks for a 20 MiB segment). So instead of replacing the
allocator, this mode catches torch's factory calls (`torch.empty`, `zeros`, `ones`, `full` and
their `_like` forms) for the region's device and answers them with `Region.empty` memory. The same
code runs on the host and on a GPU, which is what lets CPU CI exercise the placement a GPU uses.

What it cannot see (tensors made by custom C++ ops, `Tensor.to`, `new_empty`, ...) stays where
torch puts it; callers that need everything inside a region check afterwards (see `adopt_into`).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from .sizes import shape_bytes

_FILLS = {torch.empty: None, torch.zeros: 0, torch.ones: 1}
_LIKE_FILLS = {torch.empty_like: None, torch.zeros_like: 0, torch.ones_like: 1}
_ROUTABLE_KWARGS = {"dtype", "device", "requires_grad", "layout", "memory_format", "pin_memory"}


class AllocateIn(TorchFunctionMode):
    """Inside the block, factory calls whose tensor would live on `device` get memory from
    `region_of(nbytes)` (a callable, so a region can be created by the first request)."""

    def __init__(self, region_of: Callable[[int], object], device: torch.device):
        super().__init__()
        self.region_of, self.device = region_of, torch.device(device)
        self.placed_bytes = 0   # what went into the region through this mode
        self.placed_count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FILLS or func is torch.full:
            placed = self._place_new(func, args, kwargs)
        elif func in _LIKE_FILLS or func is torch.full_like:
            placed = self._place_like(func, args, kwargs)
        else:
            placed = None
        return func(*args, **kwargs) if placed is None else placed

    def _place_new(self, func, args, kwargs):
        if func is torch.full:
            if len(args) != 2 or "fill_value" in kwargs:
                return None
            size, fill = args[0], args[1]
        else:
            size, fill = (args[0] if len(args) == 1 and not isinstance(args[0], int) else args), _FILLS[func]
        shape = _shape(size)
        if shape is None:
            return None
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        return self._allocate(shape, dtype, kwargs.get("device"), fill, kwargs)

    def _place_like(self, func, args, kwargs):
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        source = args[0]
        if func is torch.full_like:
            if len(args) != 2 or "fill_value" in kwargs:
                return None
            fill = args[1]
        elif len(args) != 1:
            return None
        else:
            fill = _LIKE_FILLS[func]
        fmt = kwargs.get("memory_format", torch.preserve_format)
        if fmt is torch.preserve_format and not source.is_contiguous():
            return None  # the copy would keep the source's strides; a region hands out contiguous memory
        device = kwargs.get("device", source.device)
        rest = {k: v for k, v in kwargs.items() if k != "memory_format"}
        return self._allocate(tuple(source.shape), kwargs.get("dtype") or source.dtype, device, fill, rest)

    def _allocate(self, shape, dtype, device, fill, kwargs):
        if set(kwargs) - _ROUTABLE_KWARGS or kwargs.get("pin_memory") or \
                kwargs.get("layout", torch.strided) is not torch.strided or \
                kwargs.get("memory_format", torch.contiguous_format) not in (torch.contiguous_format,
                                                                              torch.preserve_format):
            return None
        if not self._on_region_device(device) or not isinstance(dtype, torch.dtype):
            return None
        nbytes = shape_bytes(shape, dtype)
        if nbytes == 0:
            return None
        tensor = self.region_of(nbytes).empty(shape, dtype)
        if fill is not None:
            tensor.fill_(fill)
        self.placed_bytes += nbytes
        self.placed_count += 1
        return tensor.requires_grad_() if kwargs.get("requires_grad") else tensor

    def _on_region_device(self, device) -> bool:
        device = torch.device(device) if device is not None else torch.get_default_device()
        if device.type != self.device.type:
            return False
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            return index == self.device.index
        return True


def _shape(size) -> tuple[int, ...] | None:
    if isinstance(size, int) and not isinstance(size, bool):
        return (size,)
    if isinstance(size, (tuple, list, torch.Size)) and all(isinstance(n, int) and not isinstance(n, bool)
                                                          and n >= 0 for n in size):
        return tuple(size)
    return None


def adopt_into(region, tensors: list[torch.Tensor]) -> int:
    """Move each tensor outside `region` into it (one copy, `tensor.data` re-pointed, identity kept);
    returns the bytes moved. For what `AllocateIn` could not see while a model was built."""
    moved = 0
    for t in tensors:
        if t.numel() == 0 or region.contains(t):
            continue
        inside = region.empty(tuple(t.shape), t.dtype)
        inside.copy_(t.detach())
        t.data = inside
        moved += inside.nbytes
    return moved
