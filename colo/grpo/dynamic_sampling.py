"""DAPO's dynamic sampling: a group whose rewards are all equal has advantage 0 everywhere and teaches
nothing (with a token-mean loss its tokens only dilute the others'), so it is dropped, and groups of
new prompts are generated and scored until the step has as many informative groups as prompts, or
`dynamic_sampling` extra generations have been spent. The step then trains on the informative groups
it has (fewer where the extra generations ran out). Serial steps only (the groups train after the
batch is complete), one engine per rank (each rank fills its own share).

New prompts come from the task as the prompts of a step no run reaches (step + k x EXTRA_STEPS, the
k-th extra generation), so they are the same on a resumed run and differ from every real step's.
"""
from __future__ import annotations

import dataclasses

import torch

from .batch import Rollout, rollout_of
from .task import Scores, sampling_options

EXTRA_STEPS = 1_000_003


def informative_groups(scores: Scores, group_size: int) -> list[int]:
    """The groups whose scored rewards are not all equal (NaN: unscorable, left out of the comparison)."""
    groups = scores.total.view(-1, group_size)
    kept = []
    for g, rewards in enumerate(groups):
        scored = rewards[~torch.isnan(rewards)]
        if scored.numel() > 1 and bool((scored != scored[0]).any()):
            kept.append(g)
    return kept


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


def fill_with_informative_groups(step: int, rollout: Rollout, scores: Scores, *, task, strategy, config,
                                 share_size: int) -> tuple[Rollout, Scores, dict]:
    """The step's rollout and scores with its uninformative groups dropped and replaced; and the
    record's counts (dynamic_sampling/generated_groups, dropped_groups, trained_groups, extra_generations)."""
    size = config.num_generations
    generated = len(rollout.rows) // size
    kept = informative_groups(scores, size)
    picked, picked_scores = select_groups(rollout, scores, kept, size)
    rollouts, all_scores = [picked], [picked_scores]
    have, extra = len(kept), 0
    while have < share_size and extra < config.dynamic_sampling:
        extra += 1
        extra_step = step + extra * EXTRA_STEPS
        rows, prompts = task.batch(extra_step, share_size)
        sampling = sampling_options(config, task, extra_step, range(share_size))
        completions = strategy.generate(extra_step, rows, prompts, sampling).completions
        more = rollout_of(rows, prompts, completions, size)
        more_scores, _ = strategy.score(step, more, None)
        generated += share_size
        useful = informative_groups(more_scores, size)[:share_size - have]
        picked, picked_scores = select_groups(more, more_scores, useful, size)
        rollouts.append(picked)
        all_scores.append(picked_scores)
        have += len(useful)
    if have == 0:  # nothing informative at all: the step's own groups (advantage 0: only a KL term trains)
        return rollout, scores, {"dynamic_sampling/generated_groups": generated,
                                 "dynamic_sampling/dropped_groups": generated, "dynamic_sampling/trained_groups": 0,
                                 "dynamic_sampling/extra_generations": extra}
    merged = concatenated(rollouts)
    merged_scores = Scores(torch.cat([s.per_function for s in all_scores]), scores.weights, scores.names)
    return merged, merged_scores, {"dynamic_sampling/generated_groups": generated,
                                   "dynamic_sampling/dropped_groups": generated - have,
                                   "dynamic_sampling/trained_groups": have,
                                   "dynamic_sampling/extra_generations": extra}
