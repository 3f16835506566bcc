"""The training phase's memory: gradients and optimizer state in pool regions that sleep during generation.

- `grads` region: one flat buffer per dtype; every parameter's `.grad` is a view of it, so autograd
  accumulates in place, gradient averaging is one all-reduce per buffer, and clipping is one norm.
  With 16-bit parameters it holds fp32 main gradients instead (colo.MasterWeightOptimizer's hooks
  add each 16-bit gradient into them). Its contents are dead between steps, so it sleeps without
  offload while the engine generates.
- `optimizer` region: the optimizer's parameter-shaped state tensors (AdamW's two moments) moved
  into one flat buffer per dtype, and, with 16-bit parameters, the fp32 master weights. Where the
  pool cannot hold them beside the engine's weights and KV cache, they are copied to a host buffer
  while the engine generates (the copy starts after the optimizer step and the gradients' release,
  without waiting for it, and overlaps the publish; the region sleeps at the end of the step);
  before the next optimizer step they are copied
  back on the pool's copy stream, started early so the copy overlaps forward and backward.

Budgets are exact (what the buffers need). Both regions sleep while the engine generates (the
optimizer's only when it is offloaded), and the pool lends asleep budgets to awake regions, so the KV
cache may use these bytes during generation.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from ..clipping import refuse_non_finite_steps
from ..mixed_precision import MasterWeightOptimizer
from ..regions import GRADS, OPTIMIZER
from ..sizes import tensor_bytes
from ..zero import ShardedMasterWeightOptimizer, ShardLayout

_SLACK = 1 << 20  # per-allocation alignment and rounding inside a region
_NOTHING_TO_COPY = object()  # an offload started before the optimizer had any state
_MASTER_BYTES, _MAIN_GRAD_BYTES = 4, 4  # fp32 per parameter


def adam_state_bytes(params) -> int:
    """Bytes of AdamW's two moment buffers for these parameters (in the dtype the optimizer steps in)."""
    return 2 * sum(p.numel() * max(p.element_size(), 4) for p in params)


def uses_master_weights(params) -> bool:
    """16-bit parameters train through fp32 master weights."""
    return any(p.dtype in (torch.bfloat16, torch.float16) for p in params)


class TrainingMemory:
    """Owns the gradient and optimizer-state buffers of `params` inside `pool`.

    offload_optimizer: None (auto) offloads the optimizer state while generating only where the pool
    needs it (must_offload); True/False force it.
    shard: a colo.zero.ShardLayout (ZeRO-1): the optimizer region holds only this rank's shard of the
    masters and moments, and the grads region the fp32 main gradients over the whole weight store;
    shard_group: the ranks it is sharded over (None: every rank).
    scales: {parameter: s} for parameters that hold s times what the optimizer steps (a LoRA adapter
    in vLLM's slot, colo.lora): they train through fp32 masters whatever their dtype.
    """

    def __init__(self, pool, params, *, offload_optimizer: bool | None = None, shard: ShardLayout | None = None,
                 shard_group=None, scales: dict | None = None):
        self.pool, self.shard_group = pool, shard_group
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        if scales and shard is not None:
            raise NotImplementedError("shard_optimizer with scaled (LoRA) parameters: an adapter's optimizer "
                                      "state is small; train it unsharded")
        self.scales = scales or None
        self.master_weights = uses_master_weights(self.params) or self.scales is not None
        self.shard = shard
        numel = sum(p.numel() for p in self.params)
        by_dtype = defaultdict(list)
        for p in self.params:
            by_dtype[p.dtype].append(p)
        if shard is not None:
            grad_bytes = shard.numel * _MAIN_GRAD_BYTES
            state_bytes = shard.owned_numel * (2 * 4 + (_MASTER_BYTES if self.master_weights else 0))
        else:
            grad_bytes = numel * _MAIN_GRAD_BYTES if self.master_weights else tensor_bytes(self.params)
            state_bytes = adam_state_bytes(self.params) + (numel * _MASTER_BYTES if self.master_weights else 0)
        self.grads = pool.region(GRADS, budget=grad_bytes + _SLACK * len(by_dtype))
        self.optimizer_region = pool.region(OPTIMIZER, budget=state_bytes + 4 * _SLACK)
        self.offload_optimizer = self.must_offload() if offload_optimizer is None else offload_optimizer
        self.flat_grads: dict[torch.dtype, torch.Tensor] = {}
        if not self.master_weights and shard is None:
            for dtype, group in by_dtype.items():
                flat = self.grads.zeros((sum(p.numel() for p in group),), dtype=dtype)
                offset = 0
                for p in group:
                    p.grad = flat[offset:offset + p.numel()].view_as(p)
                    offset += p.numel()
                self.flat_grads[dtype] = flat
        self._masters: torch.Tensor | None = None   # fp32 master weights in the region (16-bit parameters)
        self._state_flat: list[torch.Tensor] = []   # optimizer state buffers in the region
        self._state_host: list[torch.Tensor] = []   # their host copies while offloaded
        self._prefetch = None                        # colo.Event of the copy back, if in flight
        self._offload = None                         # colo.Event of the copy out, if started

    def must_offload(self) -> bool:
        """Whether the optimizer state cannot stay in the pool while the engine generates: its budget
        does not fit beside the regions awake then (the engine's weights and KV cache) and what lives
        outside the regions. Offloading only then keeps 8-16 bytes per parameter off the critical path."""
        generating = sum(r.budget for r in self.pool.regions.values() if r not in (self.grads, self.optimizer_region))
        return self.optimizer_region.budget > self.pool.capacity - self.pool.outside_bytes - generating

    def build_optimizer(self, optimizer_class=torch.optim.AdamW, rounding: str = "nearest", seed: int = 0, **kwargs):
        """The optimizer over these parameters: `optimizer_class` itself for fp32 parameters; for
        16-bit ones a colo.MasterWeightOptimizer with its masters in the optimizer region and its fp32
        main gradients in the grads region, writing the masters into the weights by `rounding`
        (colo.mixed_precision.MasterRounding, seeded with `seed`)."""
        if self.shard is not None:
            optimizer = ShardedMasterWeightOptimizer(self.params, optimizer_class, layout=self.shard, group=self.shard_group,
                                                     master_region=self.optimizer_region, grad_region=self.grads,
                                                     rounding=rounding, seed=seed, **kwargs)
        elif self.master_weights:
            optimizer = MasterWeightOptimizer(self.params, optimizer_class, master_region=self.optimizer_region,
                                              grad_region=self.grads, scales=self.scales, rounding=rounding, seed=seed,
                                              **kwargs)
        else:  # the scheduler steps only on finite gradients; the guard holds the optimizer to it too
            optimizer = optimizer_class(self.params, **kwargs)
            refuse_non_finite_steps(optimizer)
            return optimizer
        self.flat_grads = {torch.float32: optimizer.grad_flat}
        self._masters = optimizer.master_flat  # None: fp32 weights sharded are their own masters
        self._state_flat = [self._masters] if self._masters is not None else []
        return optimizer

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state (masters and moments) this rank keeps in its optimizer region."""
        return tensor_bytes(self._state_flat)

    # -- gradients ---------------------------------------------------------------------------------
    def zero_grads(self) -> None:
        for flat in self.flat_grads.values():
            flat.zero_()

    def check_grads_attached(self) -> None:
        """Something (optimizer.zero_grad(set_to_none=True), a user hook) may have dropped our views."""
        if self.master_weights or self.shard is not None:
            return  # the main gradients are the masters' .grad, which only the optimizer sets
        for p in self.params:
            if p.grad is None or not self.grads.contains(p.grad):
                raise RuntimeError("a parameter's .grad is no longer a view of the grads region; "
                                   "call zero_grads() instead of optimizer.zero_grad()")

    # -- optimizer state ---------------------------------------------------------------------------
    def adopt_optimizer_state(self, optimizer) -> None:
        """Move the optimizer's parameter-shaped state tensors into the optimizer region.

        Call after the optimizer created its state (its first step) and after load_state_dict,
        which replaces state tensors with fresh copies.
        """
        self.finish_prefetch()
        if self.optimizer_region.asleep:
            self.optimizer_region.wake()
        inner = getattr(optimizer, "optimizer", optimizer)  # a MasterWeightOptimizer's state is its inner one's
        movable = defaultdict(list)  # dtype -> [(state dict, key, tensor)]
        for group in inner.param_groups:
            for p in group["params"]:
                for key, value in inner.state.get(p, {}).items():
                    if torch.is_tensor(value) and value.shape == p.shape and value.is_floating_point():
                        if not self.optimizer_region.contains(value):
                            movable[value.dtype].append((inner.state[p], key, value))
        if not movable:
            return
        # Old buffers die with their last view; the masters stay.
        self._state_flat, self._state_host = ([self._masters] if self._masters is not None else []), []
        for dtype, entries in movable.items():
            flat = self.optimizer_region.empty((sum(v.numel() for _, _, v in entries),), dtype=dtype)
            offset = 0
            for state, key, value in entries:
                view = flat[offset:offset + value.numel()].view_as(value)
                view.copy_(value)
                state[key] = view
                offset += value.numel()
            self._state_flat.append(flat)

    def start_offload(self) -> None:
        """Start copying the optimizer state to host memory on the copy stream, ordered after the
        optimizer step on torch's stream without waiting for it here; finish_offload() releases the
        region once the copy is done."""
        if not self.offload_optimizer or self.optimizer_region.asleep or self._offload is not None:
            return
        self.finish_prefetch()
        self._offload = _NOTHING_TO_COPY
        if self._state_flat:
            on_cuda = self.pool.device.type == "cuda"
            if not self._state_host:
                self._state_host = [torch.empty(f.shape, dtype=f.dtype, pin_memory=on_cuda) for f in self._state_flat]
            if on_cuda:  # the optimizer step was queued on torch's stream: order the copy after it
                self.pool.stream("copy").torch_stream().wait_stream(torch.cuda.current_stream(self.pool.device))
            self._offload = self.pool.copy_async(list(zip(self._state_host, self._state_flat)))

    def finish_offload(self) -> None:
        """Wait for the copy start_offload() began and release the region's physical memory (before
        the optimizer's first step there may be no state yet: the region just sleeps, lending its budget)."""
        if self._offload is None:
            return
        if self._offload is not _NOTHING_TO_COPY:
            self._offload.synchronize()
        self._offload = None
        self.optimizer_region.sleep(offload=False)

    def offload_optimizer_state(self) -> None:
        """start_offload() and finish_offload() at once."""
        self.start_offload()
        self.finish_offload()

    @property
    def optimizer_state_away(self) -> bool:
        """Offloaded, or on its way out (start_offload() without finish_offload() yet)."""
        return self.optimizer_region.asleep or self._offload is not None

    def start_prefetch(self) -> None:
        """Wake the optimizer region and start copying the state back on the copy stream."""
        self.finish_offload()  # an offload still in flight ends first: its copy is what comes back
        if not self.optimizer_region.asleep:
            return
        self.optimizer_region.wake()
        if self._state_host:
            self._prefetch = self.pool.copy_async(list(zip(self._state_flat, self._state_host)))

    def finish_prefetch(self) -> None:
        """Block until the state is back; call right before optimizer.step() or anything that reads
        or replaces the state (an offload in flight is finished and undone first)."""
        if self.optimizer_state_away:
            self.start_prefetch()
        if self._prefetch is not None:
            self._prefetch.synchronize()
            self._prefetch = None

    # -- phases (colo.grpo.phases orders them) --------------------------------------------------------
    def gradients_fit_while_generating(self, activation_bytes: int = 0) -> bool:
        """Whether the gradients, and `activation_bytes` outside the regions, fit beside everything
        awake while the engine generates (the engine's weights and KV cache, the optimizer state unless
        it is offloaded): what training during generation (colo.grpo.overlap) needs of the pool."""
        offloaded = self.offload_optimizer
        generating = sum(r.budget for r in self.pool.regions.values()
                         if r is not self.grads and not (offloaded and r is self.optimizer_region))
        return self.grads.budget + activation_bytes <= self.pool.capacity - self.pool.outside_bytes - generating

    def wake_gradients(self) -> None:
        """Map the gradients back, zeroed."""
        woke = self.grads.asleep
        if woke:
            self.grads.wake()
        # Host pools hand back zero pages: writing zeros would only fault them in here, on the
        # critical path, instead of on the copy stream where wake() started doing so.
        if not (woke and self.grads.wakes_zeroed):
            self.zero_grads()
