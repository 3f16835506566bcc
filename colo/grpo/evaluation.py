"""Evaluation between steps: greedy pass@1 of the policy on an eval dataset's prompts."""
from __future__ import annotations

import torch

from . import distributed
from .step_stats import scored_mean_std
from .task import Task
from .task_setup import stop_options


def greedy_pass_at_1(engine, task: Task, max_new_tokens: int, world, timeline, step: int) -> dict:
    """One completion per row at temperature 0, each reward function's mean over the rows it scored
    ({"eval/<name>": mean}, and "eval_s"); the rows are split over the data-parallel ranks."""
    rows = list(distributed.rank_share(len(task.prompt_token_ids), world))
    prompts = [task.prompt_token_ids[r] for r in rows]
    record = {}
    with timeline.span("eval", step=step) as span:
        if engine.kv_cache_asleep:
            engine.wake_kv_cache()
        sampling = dict(n=1, max_tokens=max_new_tokens, temperature=0.0, **stop_options(task))
        outputs = engine.generate(prompts, [sampling] * len(prompts)) if prompts else []
        scores = task.score(step, rows, prompts, [c.token_ids for c in outputs]) if prompts else None
    for i, name in enumerate(task.reward_names):
        column = scores.per_function[:, i] if scores is not None else torch.empty(0)
        record[f"eval/{name}"] = scored_mean_std(column, world)[0]  # collective: every rank, rows or not
    record["eval_s"] = span["seconds"]
    return record
