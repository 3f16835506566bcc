"""TRL's vLLM importance-sampling ratio from the training forward: one log-probability pass a step, not two.

TRL 1.16 runs a no-grad forward over every generated row (`old_per_token_logps`) whenever
`use_vllm` and `vllm_importance_sampling_correction` (its default) are set, even where its own
steps are aligned (`gradient_accumulation_steps` a multiple of `steps_per_generation x
num_iterations`). There its loss would use `per_token_logps.detach()` as the old log-probabilities
(TRL says so in `_compute_loss`): the weights have not moved between the generation and the
training forward of the same rows, so that pass computes what the training forward computes again.
Its only use is the ratio exp(trainer - engine) that corrects the sampler/trainer mismatch.

colo.trl therefore skips the pass where the steps are aligned and computes the ratio and TRL's
`sampling/*` metrics from the training forward's log-probabilities, with TRL's formula (modes, clip
bounds, NaN handling). The loss, its gradients and the metrics are TRL's, up to the run-to-run noise
of a forward (tests/trl_trainer/test_trl.py compares them with TRL's own pass). Where the steps are
not aligned, TRL's pass runs as TRL wrote it.
"""
from __future__ import annotations

import math

import torch
from trl.trainer.utils import nanmax, nanmin

DEFERRED_KEYS = ("old_per_token_logps", "importance_sampling_ratio")  # what TRL's pass would have put in a batch


def steps_are_aligned(args, num_iterations: int) -> bool:
    """TRL's own test for old log-probabilities equal to the training forward's (grpo_trainer.py)."""
    return args.gradient_accumulation_steps % (args.steps_per_generation * num_iterations) == 0


def token_mask(inputs: dict) -> torch.Tensor:
    """The tokens TRL's loss and its importance sampling count: the completion's, less tool outputs."""
    mask = inputs["completion_mask"]
    return mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]


@torch.no_grad()
def importance_ratio(trainer_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                     clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """exp(trainer - engine) per token ((B, T); per row, (B, 1), for sequence modes), truncated or
    masked at the clip bounds as TRL's `vllm_importance_sampling_mode` says."""
    diff = torch.nan_to_num((trainer_logps - sampling_logps) * mask, nan=0.0)  # an unscored token: ratio 1
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    if mode in ("sequence_mask", "token_mask"):
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    raise ValueError(f"vllm_importance_sampling_mode={mode!r}: TRL knows 'token_truncate', 'token_mask', "
                     "'sequence_truncate' and 'sequence_mask'")


class SamplingMetrics:
    """TRL's `sampling/*` metrics of one generation batch, summed over its micro-batches as they train.

    TRL logs one value per generation batch: per rank the mean over its tokens (and the min and max),
    then the ranks' mean (min, max). `add` takes each micro-batch; `flush` gives TRL's values for the
    batches added since the last flush (each rank calls it at the same points: it gathers)."""

    def __init__(self):
        self.pending: dict[str, list] = {}   # mode -> [delta sum, count, max, ratio sum, count, min, max]

    @torch.no_grad()
    def add(self, mode: str, trainer_logps, sampling_logps, mask, ratio, is_mode: str) -> None:
        mask = mask.bool()
        delta = torch.abs(trainer_logps - sampling_logps)
        delta = delta[mask & ~torch.isnan(delta)]  # tokens vLLM could not score are left out, as TRL does
        ratios = ratio.flatten() if is_mode.startswith("sequence_") else ratio[mask]
        part = [delta.sum().item(), delta.numel(), delta.max().item() if delta.numel() else -math.inf,
                ratios.sum().item(), ratios.numel(), ratios.min().item() if ratios.numel() else math.inf,
                ratios.max().item() if ratios.numel() else -math.inf]
        old = self.pending.get(mode)
        self.pending[mode] = part if old is None else [
            old[0] + part[0], old[1] + part[1], max(old[2], part[2]),
            old[3] + part[3], old[4] + part[4], min(old[5], part[5]), max(old[6], part[6])]

    def flush(self, gather) -> dict[str, dict[str, float]]:
        """mode -> {metric name: value}; `gather` is accelerate's (a 1-d tensor from each rank, concatenated)."""
        out = {}
        for mode in sorted(self.pending):
            d_sum, d_n, d_max, r_sum, r_n, r_min, r_max = self.pending[mode]
            # per rank as TRL: an empty batch reports 0
            local = torch.tensor([d_sum / d_n if d_n else 0.0, d_max if d_n else 0.0, r_sum / r_n if r_n else 0.0,
                                  r_min if r_n else 0.0, r_max if r_n else 0.0], dtype=torch.float64)
            ranks = gather(local.unsqueeze(0)).view(-1, 5)
            out[mode] = {
                "sampling/sampling_logp_difference/mean": ranks[:, 0].mean().item(),
                "sampling/sampling_logp_difference/max": ranks[:, 1].max().item(),
                "sampling/importance_sampling_ratio/min": nanmin(ranks[:, 3]).item(),
                "sampling/importance_sampling_ratio/mean": ranks[:, 2].nanmean().item(),
                "sampling/importance_sampling_ratio/max": nanmax(ranks[:, 4]).item(),
            }
        self.pending.clear()
        return out

