"""The step's gradients made global and clipped: averaged over the data-parallel ranks (or, with a
sharded optimizer, reduce-scattered to their shard's rank), then clipped to the whole model's norm,
a tensor-parallel model's shards counted once."""
from __future__ import annotations

import math

import torch

from ..clipping import clip_
from . import distributed


def reduce_and_clip(memory, optimizer, world, max_norm: float | None, tp=None) -> float:
    """Make this rank's accumulated gradients the global ones and clip them (colo.clipping); returns the
    norm before clipping, the same on every rank: not finite means the optimizer must not step."""
    if memory.shard is not None:  # colo.ShardedMasterWeightOptimizer: reduce-scatter, then the global norm
        whole_model = {} if tp is None else {"weights": tp.norm_weights(optimizer.params), "sum_group": tp.group}
        return optimizer.clip_grad_norm_(max_norm, **whole_model)
    flats = list(memory.flat_grads.values())
    distributed.average_(flats, world)
    if tp is not None:  # the whole model's norm: shards summed over the ranks, replicated ones once
        # fp32 parameters keep their gradients in .grad; 16-bit ones the optimizer's fp32 main gradients
        # (colo.MasterWeightOptimizer, over the same parameters in the same order).
        grads = getattr(optimizer, "main_grads", None) or [p.grad for p in memory.params]
        norm = tp.grad_norm(memory.params, grads)
    else:
        norm = math.sqrt(sum(float(torch.linalg.vector_norm(f)) ** 2 for f in flats))
    clip_(flats, norm, max_norm)  # not finite: left as they are, and the step must not run
    return norm
