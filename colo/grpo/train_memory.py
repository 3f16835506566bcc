"""The training phase's memory: gradients and optimizer state in pool regions that sleep during generation.

- `grads` region: one flat buffer per dtype; every parameter's `.grad` is a view of it, so autograd
  accumulates in place, gradient averaging is one all-reduce per buffer, and clipping is one norm.
  Its contents are dead between steps, so it sleeps without offload while the engine generates.
- `optimizer` region: the optimizer's parameter-shaped state tensors (Adam's two moments) moved into
  one flat buffer per dtype. During generation they are copied to a host buffer and the region
  sleeps; before the optimizer step they are copied back on the pool's copy stream, started early so
  the copy overlaps the forward and backward passes.

Budgets are exact (what the buffers need). Both regions sleep while the engine generates (the
optimizer's only when it is offloaded), and the pool lends asleep budgets to awake regions, so the KV
cache may use these bytes during generation.
"""
from __future__ import annotations

from collections import defaultdict

import torch

_SLACK = 1 << 20  # per-allocation alignment and rounding inside a region


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def adam_state_bytes(params) -> int:
    """Bytes of AdamW's two moment buffers for these parameters."""
    return 2 * _bytes(params)


class TrainingMemory:
    """Owns the gradient and optimizer-state buffers of `params` inside `pool`."""

    def __init__(self, pool, params, *, optimizer_state_bytes: int, offload_optimizer: bool = True):
        self.pool = pool
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        by_dtype = defaultdict(list)
        for p in self.params:
            by_dtype[p.dtype].append(p)
        self.grads = pool.region("grads", budget=_bytes(self.params) + _SLACK * len(by_dtype))
        self.optimizer_region = pool.region("optimizer", budget=max(optimizer_state_bytes, 1) + 4 * _SLACK)
        self.offload_optimizer = offload_optimizer
        self.flat_grads: dict[torch.dtype, torch.Tensor] = {}
        for dtype, group in by_dtype.items():
            flat = self.grads.zeros((sum(p.numel() for p in group),), dtype=dtype)
            offset = 0
            for p in group:
                p.grad = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            self.flat_grads[dtype] = flat
        self._state_flat: list[torch.Tensor] = []   # optimizer state buffers in the region
        self._state_host: list[torch.Tensor] = []   # their host copies while offloaded
        self._prefetch = None                        # colo.Event of the copy back, if in flight

    # -- gradients ---------------------------------------------------------------------------------
    def zero_grads(self) -> None:
        for flat in self.flat_grads.values():
            flat.zero_()

    def check_grads_attached(self) -> None:
        """Something (optimizer.zero_grad(set_to_none=True), a user hook) may have dropped our views."""
        for p in self.params:
            if p.grad is None or not self.grads.contains(p.grad):
                raise RuntimeError("a parameter's .grad is no longer a view of the grads region; "
                                   "call zero_grads() instead of optimizer.zero_grad()")

    # -- optimizer state ---------------------------------------------------------------------------
    def adopt_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Move the optimizer's parameter-shaped state tensors into the optimizer region.

        Call after the optimizer created its state (its first step) and after load_state_dict,
        which replaces state tensors with fresh copies.
        """
        self.finish_prefetch()
        if self.optimizer_region.asleep:
            self.optimizer_region.wake()
        movable = defaultdict(list)  # dtype -> [(state dict, key, tensor)]
        for p in self.params:
            for key, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and value.shape == p.shape and value.is_floating_point():
                    if not self.optimizer_region.contains(value):
                        movable[value.dtype].append((optimizer.state[p], key, value))
        if not movable:
            return
        self._state_flat, self._state_host = [], []  # old buffers die with their last view
        for dtype, entries in movable.items():
            flat = self.optimizer_region.empty((sum(v.numel() for _, _, v in entries),), dtype=dtype)
            offset = 0
            for state, key, value in entries:
                view = flat[offset:offset + value.numel()].view_as(value)
                view.copy_(value)
                state[key] = view
                offset += value.numel()
            self._state_flat.append(flat)

    def offload_optimizer_state(self) -> None:
        """Copy the optimizer state to host memory and release the region's physical memory (before
        the optimizer's first step there is no state yet: the region just sleeps, lending its budget)."""
        if not self.offload_optimizer or self.optimizer_region.asleep:
            return
        self.finish_prefetch()
        if self._state_flat:
            on_cuda = self.pool.device.type == "cuda"
            if not self._state_host:
                self._state_host = [torch.empty(f.shape, dtype=f.dtype, pin_memory=on_cuda) for f in self._state_flat]
            if on_cuda:  # the optimizer step ran on torch's stream; the copy stream knows nothing of it
                torch.cuda.current_stream(self.pool.device).synchronize()
            self.pool.copy_async(list(zip(self._state_host, self._state_flat))).synchronize()
        self.optimizer_region.sleep(offload=False)

    def start_prefetch(self) -> None:
        """Wake the optimizer region and start copying the state back on the copy stream."""
        if not self.optimizer_region.asleep:
            return
        self.optimizer_region.wake()
        if self._state_host:
            self._prefetch = self.pool.copy_async(list(zip(self._state_flat, self._state_host)))

    def finish_prefetch(self) -> None:
        """Block until the state is back; call right before optimizer.step()."""
        if self.optimizer_region.asleep:
            self.start_prefetch()
        if self._prefetch is not None:
            self._prefetch.synchronize()
            self._prefetch = None

    # -- phases ------------------------------------------------------------------------------------
    def sleep_for_generation(self) -> None:
        """Release gradients (dead between steps) and offload the optimizer state."""
        self.offload_optimizer_state()
        if not self.grads.asleep:
            self.grads.sleep(offload=False)

    def wake_for_training(self) -> None:
        """Map the gradients back (zeroed) and start bringing the optimizer state back."""
        woke = self.grads.asleep
        if woke:
            self.grads.wake()
        # Host pools hand back zero pages: writing zeros would only fault them in here, on the
        # critical path, instead of on the copy stream where wake() started doing so.
        if not (woke and self.grads.wakes_zeroed):
            self.zero_grads()
        self.start_prefetch()
