"""Reward functions with TRL's signature, and how a run names them.

A reward function is called as TRL's GRPOTrainer calls it:

    f(prompts=..., completions=..., completion_ids=..., **columns) -> list[float | None]

prompts and completions are text, or lists of {role, content} messages when the dataset's prompts
are messages; completion_ids are token ids; every other column of the dataset reaches it by name
(`answer`, `solution`, ...), one value per completion. None means "cannot score this one" (TRL: the
completion is left out of the group's baseline and gets advantage 0); NaN, infinity or a non-number is
an error. A user's TRL reward functions therefore run unchanged.

Names (`--reward`, `load_reward`): `FILE.py:NAME`, `package.module:NAME`, or a built-in:
`math` (math-verify against the `solution` or `answer` column), `gsm8k` (the number after GSM8K's
`####` in `answer`), `regex:PATTERN` (1.0 where the completion text matches PATTERN);
`model:DIR` or `model:ORG/NAME`, a reward model (colo.grpo.reward_model: a one-label sequence classifier,
its weights asleep in the run's pool between scorings).
"""
from __future__ import annotations

import re
from typing import Callable

from .user_code import load_object

RewardFunc = Callable[..., list]


def completion_text(completion) -> str:
    """The text of a completion: itself, or the content of its last assistant message (an agentic
    rollout's messages end with the model's final turn; tool results are not its answer)."""
    if isinstance(completion, str):
        return completion
    said = [m for m in completion if m.get("role") == "assistant"] or completion
    return said[-1].get("content") or ""


def math_reward(completions, solution=None, answer=None, **kwargs) -> list[float | None]:
    """1.0 where math-verify finds the completion's answer equal to the gold one (`solution`, else
    `answer`), 0.0 where not, None where the gold answer cannot be parsed. Unlike TRL's
    accuracy_reward it also takes plain numbers and expressions, not only LaTeX."""
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError as e:
        raise ImportError("the math reward needs math-verify: pip install 'colo[tasks]'") from e
    gold_column = solution if solution is not None else answer
    if gold_column is None:
        raise ValueError("the math reward needs a `solution` or `answer` column in the dataset")
    extraction = [LatexExtractionConfig(), ExprExtractionConfig()]
    rewards = []
    for completion, gold in zip(completions, gold_column, strict=True):
        gold_parsed = parse(str(gold), extraction_config=extraction)
        if not gold_parsed:
            rewards.append(None)
            continue
        guess = parse(completion_text(completion), extraction_config=extraction)
        rewards.append(float(bool(guess) and verify(gold_parsed, guess)))
    return rewards


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _gsm8k_number(text: str) -> float | None:
    """GSM8K's answer convention: the number after `####`; else the last number in the text."""
    tail = text.split("####")[-1] if "####" in text else text
    numbers = _NUMBER.findall(tail)
    if not numbers:
        return None
    pick = numbers[0] if "####" in text else numbers[-1]
    try:
        return float(pick.replace(",", ""))
    except ValueError:
        return None


def gsm8k_reward(completions, answer=None, **kwargs) -> list[float | None]:
    """1.0 where the completion's final number equals the one after `####` in `answer`."""
    if answer is None:
        raise ValueError("the gsm8k reward needs an `answer` column (GSM8K's '... #### 42')")
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        want = _gsm8k_number(str(gold))
        if want is None:
            rewards.append(None)
            continue
        got = _gsm8k_number(completion_text(completion))
        rewards.append(float(got is not None and abs(got - want) < 1e-6 * max(1.0, abs(want))))
    return rewards


def regex_reward(pattern: str) -> RewardFunc:
    """A reward of 1.0 for completions whose text matches `pattern` (re.search, DOTALL), else 0.0."""
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ValueError(f"reward regex:{pattern}: not a regular expression: {e}") from None

    def regex(completions, **kwargs) -> list[float]:
        return [float(compiled.search(completion_text(c)) is not None) for c in completions]

    regex.__name__ = f"regex:{pattern}"
    return regex


# The columns each built-in reads (one of them): checked against the dataset before any engine starts.
math_reward.needs_one_of_columns = ("solution", "answer")
gsm8k_reward.needs_one_of_columns = ("answer",)
BUILTIN = {"math": math_reward, "gsm8k": gsm8k_reward}


def load_reward(spec: str) -> RewardFunc:
    """The reward function a name stands for (see the module doc); ValueError naming what is wrong."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if spec.startswith("regex:"):
        return regex_reward(spec[len("regex:"):])
    if spec.startswith("model:"):  # a reward model (TRL: a model id in reward_funcs)
        from .reward_model import RewardModel

        return RewardModel(spec[len("model:"):])
    if ":" not in spec:
        raise ValueError(f"reward {spec!r}: expected FILE.py:NAME, module:NAME or one of "
                         f"{', '.join(sorted(BUILTIN))}, regex:PATTERN")
    function = load_object(spec, "reward")
    where, _, name = spec.rpartition(":")
    if not callable(function):
        raise ValueError(f"reward {spec!r}: {name!r} in {where} is a {type(function).__name__}, not a function")
    return function


def reward_name(function: RewardFunc) -> str:
    """How the record names a function: a built-in by its name here, others by __name__ (as TRL)."""
    for name, builtin in BUILTIN.items():
        if function is builtin:
            return name
    return getattr(function, "__name__", None) or type(function).__name__
