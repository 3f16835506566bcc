"""Sampled completions, logged per step (TRL's log_completions): for each of the first
num_completions_to_print completions of a step (None: all of this rank's), its prompt, its text (or
token ids, for a token-level task), each reward function's value, the total reward and the advantage.
They go to OUT/completions.jsonl (one line per completion, truncated past the checkpoint on resume,
like the step log) and to each tracker (a TensorBoard text table, a W&B Table)."""
from __future__ import annotations

import math

import torch


def completion_samples(task, step: int, rollout, scores, advantages: torch.Tensor | None,
                       limit: int | None) -> list[dict]:
    count = len(rollout.completions) if limit is None else min(limit, len(rollout.completions))
    decode = getattr(task, "decode", None)
    texts = decode(rollout.completions[:count]) if decode is not None else [list(c) for c in rollout.completions[:count]]
    prompts = getattr(task, "prompts", None)
    samples = []
    for i in range(count):
        row = rollout.rows[i]
        prompt = prompts[row] if prompts is not None else list(rollout.prompts[i])
        rewards = {name: _number(scores.per_function[i, j]) for j, name in enumerate(scores.names)}
        samples.append({"step": step, "prompt": prompt, "completion": texts[i], "rewards": rewards,
                        "reward": _number(scores.total[i]),
                        "advantage": None if advantages is None else _number(advantages[i])})
    return samples


def _number(value) -> float | None:
    value = float(value)
    return None if math.isnan(value) else value  # NaN: no reward function could score it


def markdown_table(samples: list[dict]) -> str:
    """The samples as a Markdown table (TensorBoard's text tab renders it)."""
    names = list(samples[0]["rewards"]) if samples else []
    lines = ["| prompt | completion | " + " | ".join(names) + " | reward | advantage |",
             "|---|---|" + "---|" * len(names) + "---|---|"]
    for s in samples:
        cells = [_cell(s["prompt"]), _cell(s["completion"]), *[_cell(v) for v in s["rewards"].values()],
                 _cell(s["reward"]), _cell(s["advantage"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value) -> str:
    text = value if isinstance(value, str) else (f"{value:.4g}" if isinstance(value, float) else str(value))
    return text.replace("|", "\\|").replace("\n", " ")[:500]
