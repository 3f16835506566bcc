"""A small arithmetic dataset for the README's worked example and the tests: chat prompts asking for
the sum or product of two small numbers, with the answer in an `answer` column (the `math` reward
reads it). Written offline, seeded, in TRL's conventions.

    python -m colo.grpo.arithmetic DIR [--train N] [--eval N] [--seed S]   # DIR/train.jsonl, DIR/eval.jsonl
    python -m colo.grpo.arithmetic DIR --tool-sums [--show-call]           # 4-5 digit sums, for `add`

--tool-sums writes the agentic example's task (docs/agentic.md): sums of two 4-5 digit numbers, which
a 135M model cannot add in its head but can with a tool; `add` here is that tool (`--tool
colo.grpo.arithmetic:add`), `final_number` the reward (`--reward colo.grpo.arithmetic:final_number`).
--show-call puts a demonstrated exchange before each question: a sum, the call, the result, the answer.
"""
from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

SYSTEM = "Answer with the number only."


def problems(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        if rng.random() < 0.5:
            question, answer = f"What is {a} + {b}?", a + b
        else:
            question, answer = f"What is {a} times {b}?", a * b
        rows.append({"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                     "answer": str(answer)})
    return rows


# A demonstrated exchange (a user's sum, the assistant's call, the tool's result, the answer) before the
# question: SmolLM2-135M wrote no well-formed call when only told how (in a system message).
DEMONSTRATION = [
    {"role": "user", "content": "What is 1234 + 5678?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1234, "b": 5678}}}]},
    {"role": "tool", "name": "add", "content": "6912"},
    {"role": "assistant", "content": "6912"},
]


def add(a: int, b: int) -> int:
    """Add two whole numbers exactly.

    Args:
        a: the first number
        b: the second number
    """
    return int(a) + int(b)


def final_number(completions, answer, **kwargs) -> list[float]:
    """1.0 where the last number in the completion's final answer is the `answer` column's. Stricter than
    the math reward, which evaluates an expression it finds: a completion that only restates "a + b"
    would score there."""
    from .rewards import completion_text

    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        numbers = re.findall(r"-?\d[\d,]*", completion_text(completion))
        rewards.append(float(bool(numbers) and numbers[-1].replace(",", "") == str(gold)))
    return rewards


def tool_sums(count: int, seed: int, show_call: bool = False) -> list[dict]:
    """Sums of two 4-5 digit numbers as chat prompts; with show_call, a demonstrated call before each."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(1000, 99999), rng.randint(1000, 99999)
        shown = DEMONSTRATION if show_call else []
        rows.append({"prompt": [*shown, {"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)})
    return rows


def write(directory: str | Path, train: int = 256, eval: int = 32, seed: int = 0, tool_sums_task: bool = False,
          show_call: bool = False) -> tuple[Path, Path]:
    """Write DIR/train.jsonl and DIR/eval.jsonl (disjoint seeds) and return their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, count, offset in (("train", train, 0), ("eval", eval, 1)):
        path = directory / f"{name}.jsonl"
        rows = tool_sums(count, seed * 2 + offset, show_call) if tool_sums_task else problems(count, seed * 2 + offset)
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        paths.append(path)
    return paths[0], paths[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m colo.grpo.arithmetic", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--train", type=int, default=256)
    parser.add_argument("--eval", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tool-sums", action="store_true", help="4-5 digit sums, for the add tool")
    parser.add_argument("--show-call", action="store_true", help="with --tool-sums: a demonstrated call before each question")
    args = parser.parse_args()
    for path in write(args.directory, args.train, args.eval, args.seed, args.tool_sums, args.show_call):
        print(path)
