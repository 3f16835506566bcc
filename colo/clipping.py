"""The one gradient-clipping rule of every optimizer path: colo.MasterWeightOptimizer, ZeRO-1
(colo.ShardedMasterWeightOptimizer), tensor parallelism and colo.grpo's fp32 AdamW.

Gradients whose global L2 norm is above max_norm are scaled by max_norm / (norm + 1e-6), as
torch.nn.utils.clip_grad_norm_ scales them. A norm that is not finite (an inf or a NaN anywhere) is
refused: nothing is scaled (max_norm / inf is 0, and 0 x inf is NaN) and the caller skips the
optimizer step, so the weights, which the engine serves, stay finite.
"""
from __future__ import annotations

import math

import torch


def clip_(grads: list[torch.Tensor], norm: float, max_norm: float | None) -> bool:
    """Scale `grads` (whose global norm is `norm`) down to `max_norm` (None: no clipping); False,
    touching nothing, when the norm is not finite: then the optimizer must not step."""
    if not math.isfinite(norm):
        return False
    if max_norm is not None and norm > max_norm:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
    return True
