"""The learning-rate schedule: a multiplier of the learning rate per optimizer step, as transformers'
get_{constant,linear,cosine}_schedule_with_warmup give TRL's trainers, warm-up included. colo's
warm-up is linear from 1/warmup at the first step (transformers' starts at 0: its first step does not
train). The multiplier is a function of the step alone, so a resumed run continues it exactly (the
checkpoint holds the optimizer-step count, LambdaLR's last_epoch)."""
from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def warmup_of(warmup_steps: int, warmup_ratio: float, max_steps: int | None) -> int:
    """Warm-up steps: warmup_steps, else warmup_ratio of max_steps (rounded up, as transformers does)."""
    if warmup_steps:
        return warmup_steps
    return math.ceil(warmup_ratio * max_steps) if warmup_ratio and max_steps else 0


def lr_multiplier(step: int, kind: str, warmup: int, max_steps: int | None) -> float:
    """The learning rate's multiplier at optimizer step `step` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = (step - warmup) / max(1, max_steps - warmup)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
