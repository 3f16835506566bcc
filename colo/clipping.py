"""The one gradient-clipping rule of every optimizer path: colo.MasterWeightOptimizer, ZeRO-1
(colo.ShardedMasterWeightOptimizer), tensor parallelism and colo.grpo's fp32 AdamW; and the refusal
of a step on gradients that are not finite for optimizers colo did not build (refuse_non_finite_steps).

Gradients whose global L2 norm is above max_norm are scaled by max_norm / (norm + 1e-6), as
torch.nn.utils.clip_grad_norm_ scales them. A norm that is not finite (an inf or a NaN anywhere) is
refused: nothing is scaled (max_norm / inf is 0, and 0 x inf is NaN) and the caller skips the
optimizer step, so the weights, which the engine serves, stay finite.
"""
from __future__ import annotations

import logging
import math

import torch

logger = logging.getLogger(__name__)


def clip_(grads: list[torch.Tensor], norm: float, max_norm: float | None) -> bool:
    """Scale `grads` (whose global norm is `norm`) down to `max_norm` (None: no clipping); False,
    touching nothing, when the norm is not finite: then the optimizer must not step."""
    if not math.isfinite(norm):
        return False
    if max_norm is not None and norm > max_norm:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
    return True


def log_skipped_step(log: logging.Logger, owner: str, skipped: int) -> None:
    """The one warning every optimizer path gives, on its module's `log`, for a step refused on gradients
    that are not finite."""
    log.warning("%s: the gradients are not finite; step skipped, the weights untouched (%d so far)", owner, skipped)


def gradients_finite(grads: list[torch.Tensor]) -> bool:
    """Whether no gradient holds an inf or a NaN (one device sync for all of them): each one's smallest and
    largest value, which a NaN anywhere makes NaN and an inf makes infinite. One reduction a tensor that
    allocates nothing, where torch.isfinite(g).all() writes a mask as large as the gradient first
    (bench/results/cpu-huge-pages-zen5.json)."""
    bounds = [torch.stack(torch.aminmax(g)).float() for g in grads if g.numel()]
    return not bounds or bool(torch.isfinite(torch.cat(bounds)).all())


class NonFiniteStepGuard:
    """A torch optimizer's step on gradients that are not finite changes nothing: a step pre-hook looks
    at the gradients of the optimizer's parameters and, when any holds an inf or a NaN, drops them all
    (torch's optimizers pass over a parameter without a gradient, so neither the weights, which an
    engine may serve, nor the optimizer's state move), logs it and counts it in `skipped_steps`.

    For optimizers colo did not build: the plain fp32 path, TRL's in colo.trl, your own. colo's
    master-weight optimizers refuse such a step themselves (colo.mixed_precision)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.skipped_steps = 0
        self._handle = optimizer.register_step_pre_hook(self._refuse)

    def _refuse(self, optimizer, args, kwargs) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if gradients_finite([p.grad for p in params]):
            return
        for p in params:
            p.grad = None
        self.skipped_steps += 1
        log_skipped_step(logger, type(optimizer).__name__, self.skipped_steps)

    def remove(self) -> None:
        self._handle.remove()


def refuse_non_finite_steps(optimizer: torch.optim.Optimizer) -> NonFiniteStepGuard:
    """Make `optimizer` skip any step() whose gradients are not finite (see NonFiniteStepGuard); the
    guard's `skipped_steps` counts them. Register it after hooks that fill the gradients it steps
    (colo.optimizer_masters.FP32Masters does so itself)."""
    return NonFiniteStepGuard(optimizer)
