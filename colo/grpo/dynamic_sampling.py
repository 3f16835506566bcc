"""DAPO's dynamic sampling: a group whose rewards are all equal (under normalize_then_sum: each reward
function's) has advantage 0 everywhere and teaches nothing (with a token-mean loss its tokens only
dilute the others'), so it is dropped, and groups of new prompts are generated and scored until the
step has as many informative groups as prompts, or `dynamic_sampling` extra generations have been
spent. The step then trains on the informative groups it has (fewer where the extra generations ran
out; the step's own groups where none is informative, so that only the KL term trains). One engine
per rank: each rank fills its own share.

Serial steps pick the groups after each generation (fill_with_informative_groups). Overlapped ones
(colo.grpo.overlap) train each informative group as soon as it finishes and generate the replacement
prompts while the groups picked so far train (replace_while_training); both pick the same groups:
the first informative ones in prompt order.

New prompts come from the task as the prompts of a step no run reaches (step + k x EXTRA_STEPS, the
k-th extra generation), each rank its share as for a real step, so they are the same on a resumed run
and differ from every real step's.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .batch import Rollout, concatenated_scores, rollout_of
from .loss import normalized_sum
from .task import Scores, rank_batch

EXTRA_STEPS = 1_000_003


def _not_all_equal(rewards: torch.Tensor) -> bool:
    scored = rewards[~torch.isnan(rewards)]   # NaN: unscorable, left out of the comparison
    return scored.numel() > 1 and bool((scored != scored[0]).any())


def _advantage_sources(scores: Scores, group_size: int, aggregation: str) -> torch.Tensor:
    """Per group (a row of `group_size`), what its advantages are computed from: the weighted reward
    totals, or under normalize_then_sum (GDPO) the weighted sums of each function's group-normalized
    rewards, which differ within a group whose totals are equal when the functions' rewards do not."""
    if aggregation == "normalize_then_sum":
        return normalized_sum(scores.per_function, scores.weights, group_size).view(-1, group_size)
    return scores.total.view(-1, group_size)


def informative(scores: Scores, aggregation: str = "sum_then_normalize") -> bool:
    """Whether one group's advantages are not all 0 (its scored rewards, or under normalize_then_sum
    its normalized sums, not all equal)."""
    return _not_all_equal(_advantage_sources(scores, len(scores.total), aggregation)[0])


def informative_groups(scores: Scores, group_size: int, aggregation: str = "sum_then_normalize") -> list[int]:
    """The groups (of `group_size` completions each) whose advantages are not all 0 (see informative)."""
    return [g for g, values in enumerate(_advantage_sources(scores, group_size, aggregation)) if _not_all_equal(values)]


def select_groups(rollout: Rollout, scores: Scores, groups: list[int], group_size: int) -> tuple[Rollout, Scores]:
    rows = [g * group_size + i for g in groups for i in range(group_size)]
    return rollout.select(rows), Scores(scores.per_function[rows], scores.weights, scores.names)


def concatenated(rollouts: list[Rollout]) -> Rollout:
    """The rollouts one after the other (a field that one lacks stays None only where all lack it)."""
    values = {}
    for f in dataclasses.fields(Rollout):
        parts = [getattr(r, f.name) for r in rollouts]
        if all(p is None for p in parts):
            values[f.name] = None
        else:
            values[f.name] = [x for r, p in zip(rollouts, parts) for x in (p if p is not None else [None] * len(r.rows))]
    return Rollout(**values)


def extra_batch(step: int, extra: int, *, task, config, world, engine) -> tuple[list, list, list[dict]]:
    """(rows, prompts, sampling options) of this rank's share of the step's `extra`-th extra generation:
    the batch of a step no real step reaches (colo.grpo.task.rank_batch)."""
    return rank_batch(task, config, world, step + extra * EXTRA_STEPS, engine)


def counts(generated: int, trained: int, extra: int) -> dict:
    """The record's dynamic-sampling fields (groups generated, dropped, trained; extra generations)."""
    return {"dynamic_sampling/generated_groups": generated, "dynamic_sampling/dropped_groups": generated - trained,
            "dynamic_sampling/trained_groups": trained, "dynamic_sampling/extra_generations": extra}


def fill_with_informative_groups(step: int, rollout: Rollout, scores: Scores, *, task, config, world, engine,
                                 generate: Callable, score: Callable) -> tuple[Rollout, Scores, dict]:
    """Serial steps: the step's rollout and scores with its uninformative groups dropped and replaced,
    and the record's counts. generate(rows, prompts, sampling) -> the engine's completions;
    score(rollout) -> its Scores."""
    size = config.num_generations
    share_size = len(rollout.rows) // size
    generated = share_size
    aggregation = config.multi_objective_aggregation
    kept = informative_groups(scores, size, aggregation)
    picked, picked_scores = select_groups(rollout, scores, kept, size)
    rollouts, all_scores = [picked], [picked_scores]
    have, extra = len(kept), 0
    while have < share_size and extra < config.dynamic_sampling:
        extra += 1
        rows, prompts, sampling = extra_batch(step, extra, task=task, config=config, world=world, engine=engine)
        more = rollout_of(rows, prompts, generate(rows, prompts, sampling), size)
        more_scores = score(more)
        generated += len(prompts)
        useful = informative_groups(more_scores, size, aggregation)[:share_size - have]
        picked, picked_scores = select_groups(more, more_scores, useful, size)
        rollouts.append(picked)
        all_scores.append(picked_scores)
        have += len(useful)
    if have == 0:
        return rollout, scores, counts(generated, 0, extra)
    return concatenated(rollouts), concatenated_scores(all_scores), counts(generated, have, extra)


def replace_while_training(step: int, overlapped, *, task, config, world, engine, rollouts: Callable) -> None:
    """Overlapped steps, after the step's own generation (its informative groups picked as they
    finished, colo.grpo.overlap.OverlappedStep with keep=informative): generate the replacement prompts
    while those train, each round picking at most the groups still missing. rollouts(rows, prompts,
    sampling, on_group=) generates."""
    share_size = overlapped.rounds[0].size
    extra = 0
    while len(overlapped.picked()) < share_size and extra < config.dynamic_sampling:
        extra += 1
        rows, prompts, sampling = extra_batch(step, extra, task=task, config=config, world=world, engine=engine)
        rollouts(rows, prompts, sampling,
                 on_group=overlapped.round(rows, prompts, quota=share_size - len(overlapped.picked())))
    if not overlapped.picked():
        for index in range(share_size):
            overlapped.train(index)


def overlapped_result(overlapped) -> tuple[Rollout, Scores, dict]:
    """What an overlapped step with dynamic sampling trained on (its groups, in the order picked), their
    scores, and the record's counts."""
    picked = overlapped.picked()
    trained = picked or range(overlapped.rounds[0].size)
    return (concatenated([overlapped.works[i][0] for i in trained]),  # a work: (the group's Rollout, advantages)
            concatenated_scores([overlapped.scores[i] for i in trained]),
            counts(sum(r.size for r in overlapped.rounds), len(picked), len(overlapped.rounds) - 1))
