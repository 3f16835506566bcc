"""What a step reports that spans ranks: reward and completion statistics over every data-parallel
rank's batch, the loss statistics averaged over them, and each region's resident bytes per phase."""
from __future__ import annotations

import math

import torch

from . import distributed
from ..sizes import rss_bytes
from .metrics import GpuMonitor


def scored_mean_std(values: torch.Tensor, world) -> tuple[float, float]:
    """Mean and std (Bessel's correction, as TRL's nanstd) of the non-NaN values of every
    data-parallel rank's batch."""
    scored = values[~torch.isnan(values)].double()
    n, total, squares = distributed.sum_floats([scored.numel(), scored.sum().item(), (scored ** 2).sum().item()],
                                     world, data_parallel=True)
    mean = total / n if n else math.nan
    std = math.sqrt(max(squares - total * mean, 0.0) / (n - 1)) if n > 1 else 0.0
    return mean, std


def reward_stats(scores, rollout, world) -> dict:
    """Rewards overall and per function (mean, std, as TRL logs them) and the completions' lengths."""
    record = {}
    record["reward_mean"], record["reward_std"] = scored_mean_std(scores.total, world)
    for i, name in enumerate(scores.names):
        record[f"rewards/{name}/mean"], record[f"rewards/{name}/std"] = scored_mean_std(scores.per_function[:, i],
                                                                                        world)
    lengths = [len(c) for c in rollout.completions]
    n, tokens, clipped, unscored = distributed.sum_floats(
        [len(lengths), sum(lengths), sum(rollout.truncated), float(torch.isnan(scores.total).sum())],
        world, data_parallel=True)
    shortest, longest = distributed.min_max(min(lengths), max(lengths), world)
    record.update(tokens_generated=int(tokens), completion_length_mean=tokens / n, completion_length_min=shortest,
                  completion_length_max=longest, clipped_ratio=clipped / n, unscored_completions=int(unscored))
    return record


def train_stats(stats: dict, world) -> dict:
    """Loss, clip fraction and KL averaged over the data-parallel ranks; where the sampled tokens'
    engine log-probabilities were compared, the trainer's gap to them."""
    record = dict(zip(("loss", "clip_fraction", "kl"), (
        v / world.dp_size for v in distributed.sum_floats([stats["loss"], stats["clip_fraction"], stats["kl"]], world,
                                                data_parallel=True))))
    if "engine_logprob_max_abs_diff" in stats:
        gap, tokens = distributed.sum_floats([stats["engine_logprob_abs_diff_sum"], stats["engine_logprob_tokens"]],
                                   world, data_parallel=True)
        record["engine_logprob_max_abs_diff"] = distributed.min_max(0.0, stats["engine_logprob_max_abs_diff"], world)[1]
        record["engine_logprob_mean_abs_diff"] = gap / max(tokens, 1.0)
    return record


class Residency:
    """The pool's resident bytes per region (and the process's RSS, and the GPU's NVML figures),
    the largest seen in each phase kept in a step's record."""

    def __init__(self, pool, device):
        self.pool = pool
        self.gpu = GpuMonitor(device)

    def resident(self) -> dict:
        return {name: s["resident_bytes"] for name, s in self.pool.stats().items()}

    def sample(self, phase: str, record: dict) -> None:
        for region, nbytes in [*self.resident().items(), ("rss", rss_bytes())]:
            key = f"{region}_resident_bytes_during_{phase}"
            record[key] = max(record.get(key, 0), nbytes)
        for key, value in self.gpu.sample().items():
            record[f"{key}_{phase}"] = value
