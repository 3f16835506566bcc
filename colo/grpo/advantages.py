"""A completion's advantage from its reward, by the run's `advantage_estimator` (verl's names).

- grpo: the group's mean taken off, divided by the group's std, the batch's or nothing
  (colo.grpo.loss.group_advantages, TRL's GRPOTrainer).
- rloo: REINFORCE leave-one-out, as TRL's RLOOTrainer computes it (trl/trainer/rloo_trainer.py,
  `_generate_and_score_completions`): the baseline of a completion is the mean reward of its scorable
  siblings (a group with one scorable completion: advantage 0); with normalize_advantages, the
  advantages are then normalized over the whole batch ((a - mean) / (std + 1e-4), Bessel's std, as
  TRL's over its gathered batch).
- reinforce_plus_plus: REINFORCE++ as verl computes it (verl/trainer/ppo/core_algos.py,
  `compute_reinforce_plus_plus_outcome_advantage`, gamma 1, its default): the outcome reward is every
  token's return, and the returns are whitened over every response token of the batch
  (`masked_whiten`: mean and Bessel-corrected variance over the tokens, 1e-8 added). A completion's
  tokens share one return, so its advantage is one number: (r - token mean) / sqrt(token var + 1e-8),
  the statistics weighted by each completion's model tokens. verl puts the KL in the reward
  (use_kl_in_reward) or in the loss (use_kl_loss); colo keeps it in the loss (--beta, the k3 estimator).

Every estimator gives an unscorable completion (NaN reward: no reward function scored it) advantage 0
and leaves it out of the others' statistics. Batch statistics are every data-parallel rank's.
"""
from __future__ import annotations

import math

import torch

from .distributed import sum_floats
from .loss import ADVANTAGE_EPS, batch_advantages, group_advantages, normalized_sum
from .metrics import scored_mean_std

WHITEN_EPS = 1e-8  # verl's masked_whiten


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """reward - the mean of its scorable siblings' rewards, per group of `group_size`; NaN where it has
    none or is unscorable itself (the caller zeroes those, after any normalization)."""
    if group_size < 2:
        return torch.zeros_like(rewards)
    grouped = rewards.view(-1, group_size)
    scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baselines = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scorable - 1)
    return (grouped - baselines).reshape(-1)


def token_whitened(rewards: torch.Tensor, tokens: torch.Tensor, world) -> torch.Tensor:
    """REINFORCE++'s advantages (see the module): `rewards` whitened over the batch's tokens, each
    completion's reward counted once per token of `tokens`."""
    scored = ~torch.isnan(rewards)
    r, w = rewards[scored].double(), tokens[scored].double()
    n, total, squares = sum_floats([w.sum().item(), (w * r).sum().item(), (w * r * r).sum().item()], world,
                                   data_parallel=True)
    if n < 2:  # verl refuses fewer than two tokens; nothing here to whiten against
        return torch.zeros_like(rewards)
    mean = total / (n + WHITEN_EPS)
    variance = (squares - 2 * mean * total + mean * mean * n) / (n + WHITEN_EPS) * n / (n - 1)
    return torch.nan_to_num((rewards - mean) / math.sqrt(max(variance, 0.0) + WHITEN_EPS), nan=0.0)


def advantages_of(scores, config, world, tokens: list[int] | None = None) -> torch.Tensor:
    """Each completion's advantage by config.advantage_estimator (a collective where the batch's
    statistics are needed). tokens: each completion's model tokens (reinforce_plus_plus)."""
    estimator, n = config.advantage_estimator, config.num_generations
    if torch.isinf(scores.total).any():
        raise ValueError("rewards contain infinity; the reward function must return finite numbers")
    if estimator == "rloo":
        advantages = rloo_advantages(scores.total, n)
        if config.normalize_advantages:
            mean, std = scored_mean_std(advantages, world)
            advantages = (advantages - mean) / (std + ADVANTAGE_EPS)
        return torch.nan_to_num(advantages, nan=0.0)
    if estimator == "reinforce_plus_plus":
        if tokens is None:
            raise ValueError("reinforce_plus_plus whitens over the batch's tokens: pass each completion's tokens")
        return token_whitened(scores.total, torch.tensor(tokens, dtype=torch.float64), world).float()
    if config.multi_objective_aggregation == "normalize_then_sum":  # TRL's GDPO aggregation
        sums = normalized_sum(scores.per_function, scores.weights, n)
        return batch_advantages(sums, *scored_mean_std(sums, world))
    # scale_rewards="batch": the std of every rank's rewards
    batch_std = scored_mean_std(scores.total, world)[1] if config.scale_rewards == "batch" else None
    return group_advantages(scores.total, n, scale=config.scale_rewards, allow_unscorable=True, batch_std=batch_std)


def needs_the_whole_batch(config) -> str | None:
    """Why no group's advantages can be computed before the whole batch is scored (None: they can)."""
    if config.advantage_estimator == "reinforce_plus_plus":
        return "advantage_estimator='reinforce_plus_plus': every advantage needs the whole batch's token statistics"
    if config.advantage_estimator == "rloo" and config.normalize_advantages:
        return "normalize_advantages: every advantage needs the whole batch's advantages"
    if config.multi_objective_aggregation == "normalize_then_sum":
        return "multi_objective_aggregation='normalize_then_sum': every advantage needs the whole batch's rewards"
    if config.scale_rewards == "batch":
        return "scale_rewards='batch': every advantage needs the std of the whole batch's rewards"
    return None
