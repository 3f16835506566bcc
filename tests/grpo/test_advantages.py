"""colo.grpo's advantage estimators on hand-made rewards, against TRL's and verl's own formulas.

TRL's RLOO baseline is inline in RLOOTrainer._generate_and_score_completions (trl 1.16); verl's
REINFORCE++ is compute_reinforce_plus_plus_outcome_advantage with masked_whiten (verl commit b178a3c,
verl/trainer/ppo/core_algos.py and verl/utils/torch_functional.py). Both are transcribed below as
their code computes (per token for verl, on a (batch, tokens) return tensor), so the per-completion
forms colo uses are checked against them, not against themselves.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from colo.grpo.advantages import advantages_of, needs_the_whole_batch, rloo_advantages
from colo.grpo.config import GRPOConfig
from colo.grpo.task import Scores

ONE_RANK = SimpleNamespace(size=1, dp_size=1)


def scores_of(rewards) -> Scores:
    total = torch.tensor(rewards, dtype=torch.float32)
    return Scores(total.unsqueeze(1), torch.ones(1), ["r"])


def config(**settings):
    return SimpleNamespace(**{**dict(advantage_estimator="grpo", num_generations=4, normalize_advantages=False,
                                     multi_objective_aggregation="sum_then_normalize", scale_rewards="group"),
                              **settings})


def trl_rloo(rewards: torch.Tensor, num_generations: int, normalize: bool) -> torch.Tensor:
    """TRL 1.16's RLOOTrainer, its lines from the grouped rewards to nan_to_num (nanstd: TRL's, Bessel)."""
    grouped_rewards = rewards.view(-1, num_generations)
    scorable_counts = (~torch.isnan(grouped_rewards)).sum(dim=1, keepdim=True)
    grouped_sum = torch.nansum(grouped_rewards, dim=1, keepdim=True)
    baselines = (grouped_sum - grouped_rewards) / (scorable_counts - 1)
    advantages = rewards - baselines.view(-1)
    if normalize:
        scored = advantages[~torch.isnan(advantages)]
        advantages = (advantages - torch.nanmean(advantages)) / (scored.std() + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def verl_reinforce_plus_plus(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma=1.0):
    """verl's compute_reinforce_plus_plus_outcome_advantage with masked_whiten, as written there."""
    returns = torch.zeros_like(token_level_rewards)
    running_return = 0
    for t in reversed(range(token_level_rewards.shape[1])):
        running_return = token_level_rewards[:, t] + gamma * running_return
        returns[:, t] = running_return
        running_return = running_return * response_mask[:, t]
    mean = (returns * response_mask).sum() / (response_mask.sum() + 1e-8)
    variance = ((returns - mean) ** 2 * response_mask).sum() / (response_mask.sum() + 1e-8)
    variance = variance * response_mask.sum() / (response_mask.sum() - 1)
    return (returns - mean) * torch.rsqrt(variance + 1e-8) * response_mask


def test_rloo_takes_off_the_mean_of_the_scorable_siblings_as_trls_rlootrainer():
    rewards = [1.0, 0.0, 0.0, 1.0,   2.0, float("nan"), 0.5, 0.5,   3.0, float("nan"), float("nan"), float("nan")]
    # by hand: group 1: 1 - 1/3 = 2/3, 0 - 2/3; group 2 leaves its NaN out: 2 - 0.5, 0.5 - 1.25; group 3: one scorable
    expected = [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1.5, 0.0, -0.75, -0.75, 0.0, 0.0, 0.0, 0.0]
    ours = advantages_of(scores_of(rewards), config(advantage_estimator="rloo"), ONE_RANK)
    torch.testing.assert_close(ours, torch.tensor(expected))
    torch.testing.assert_close(ours, trl_rloo(torch.tensor(rewards), 4, normalize=False))
    normalized = advantages_of(scores_of(rewards), config(advantage_estimator="rloo", normalize_advantages=True),
                               ONE_RANK)
    torch.testing.assert_close(normalized, trl_rloo(torch.tensor(rewards), 4, normalize=True))
    assert normalized[9:].eq(0).all() and not torch.allclose(normalized, ours)
    assert rloo_advantages(torch.tensor([1.0, 2.0]), 1).eq(0).all()  # a group of one has no sibling


def test_reinforce_plus_plus_whitens_over_the_batchs_tokens_as_verl():
    rewards = torch.tensor([1.0, 0.0, 0.25, 1.0, 0.0, 0.5])
    lengths = [3, 5, 1, 4, 2, 5]
    width = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths])
    token_rewards = torch.zeros(len(lengths), width)
    token_rewards[torch.arange(len(lengths)), torch.tensor(lengths) - 1] = rewards  # verl: the score on the last token
    theirs = verl_reinforce_plus_plus(token_rewards.double(), mask.double())

    ours = advantages_of(scores_of(rewards.tolist()), config(advantage_estimator="reinforce_plus_plus",
                                                             num_generations=3), ONE_RANK, lengths)
    torch.testing.assert_close((ours.double().unsqueeze(1) * mask), theirs, atol=1e-6, rtol=1e-6)
    # weighted by tokens: not the plain batch normalization
    plain = (rewards - rewards.mean()) / rewards.std()
    assert (ours - plain).abs().max() > 0.05
    # an unscorable completion: advantage 0, and out of the others' statistics
    with_unscored = advantages_of(scores_of([*rewards.tolist(), float("nan")]),
                                  config(advantage_estimator="reinforce_plus_plus", num_generations=7), ONE_RANK,
                                  [*lengths, 9])
    torch.testing.assert_close(with_unscored[:-1], ours)
    assert with_unscored[-1] == 0


def test_grpo_is_unchanged_and_infinite_rewards_are_refused_by_every_estimator():
    rewards = [1.0, 0.0, 0.0, 1.0]
    grpo = advantages_of(scores_of(rewards), config(), ONE_RANK)
    half = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    torch.testing.assert_close(grpo, torch.tensor([half, -half, -half, half]))
    for estimator in ("grpo", "rloo", "reinforce_plus_plus"):
        with pytest.raises(ValueError, match="infinity"):
            advantages_of(scores_of([1.0, float("inf"), 0.0, 1.0]), config(advantage_estimator=estimator),
                          ONE_RANK, [1, 1, 1, 1])


def test_each_estimators_normalization_is_its_own():
    GRPOConfig(advantage_estimator="rloo", normalize_advantages=True)
    GRPOConfig(advantage_estimator="reinforce_plus_plus", beta=0.01)
    with pytest.raises(ValueError, match="advantage_estimator must be one of grpo, rloo, reinforce_plus_plus"):
        GRPOConfig(advantage_estimator="gae")
    with pytest.raises(ValueError, match="scale_rewards='none' is GRPO's normalization"):
        GRPOConfig(advantage_estimator="rloo", scale_rewards="none")
    with pytest.raises(ValueError, match="normalize_advantages is RLOO's"):
        GRPOConfig(normalize_advantages=True)
    with pytest.raises(ValueError, match="multi_objective_aggregation='normalize_then_sum'"):
        GRPOConfig(advantage_estimator="reinforce_plus_plus", multi_objective_aggregation="normalize_then_sum")
    # what an overlapped step (group by group) cannot compute
    assert needs_the_whole_batch(config(advantage_estimator="reinforce_plus_plus"))
    assert needs_the_whole_batch(config(advantage_estimator="rloo", normalize_advantages=True))
    assert needs_the_whole_batch(config(advantage_estimator="rloo")) is None


@pytest.mark.slow
def test_reinforce_plus_plus_whitens_over_every_ranks_tokens_and_learns(tmp_path):
    """`python -m colo.grpo --advantage-estimator reinforce_plus_plus` on the toy task, in the dtype auto
    picks: on 2 ranks each completion gets the advantage it gets on 1 rank (the token statistics are
    every rank's), and the reward rises."""
    import json

    from helpers.grpo_runs import records, run_grpo, run_grpo_ranks

    flags = ("--advantage-estimator", "reinforce_plus_plus", "--log-completions", "--keep-checkpoints", "0")
    one, two = tmp_path / "one", tmp_path / "two"
    run_grpo(one, "--steps", "10", *flags)
    run_grpo_ranks(two, 2, "--steps", "1", *flags)

    def first_step(out):
        lines = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
        return {(str(s["prompt"]), str(s["completion"])): s["advantage"] for s in lines if s["step"] == 1}

    alone, split = first_step(one), first_step(two)
    assert len(split) >= 8 and split.keys() <= alone.keys()  # the main rank's half of the batch
    assert all(split[key] == pytest.approx(alone[key], abs=1e-5) for key in split)
    assert len({round(a, 3) for a in split.values()}) > 2  # not all equal: token-weighted whitening
    log = records(one)
    assert log[-1]["reward_mean"] > log[0]["reward_mean"] + 0.15, [r["reward_mean"] for r in log]
