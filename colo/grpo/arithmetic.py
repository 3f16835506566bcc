"""A small arithmetic dataset for the README's worked example and the tests: chat prompts asking for
the sum or product of two small numbers, with the answer in an `answer` column (the `math` reward
reads it). Written offline, seeded, in TRL's conventions.

    python -m colo.grpo.arithmetic DIR [--train N] [--eval N] [--seed S]   # DIR/train.jsonl, DIR/eval.jsonl
    python -m colo.grpo.arithmetic DIR --tool-sums [--show-call]           # 4-5 digit sums, for `add`
    python -m colo.grpo.arithmetic DIR --few-shot N                        # plain text, for a base model

--tool-sums writes the agentic example's task (docs/agentic.md): sums of two 4-5 digit numbers, which
a 135M model cannot add in its head but can with a tool; `add` here is that tool (`--tool
colo.grpo.arithmetic:add`), `final_number` the reward (`--reward colo.grpo.arithmetic:final_number`).
--show-call puts a demonstrated exchange before each question: a sum, the call, the result, the answer.

--few-shot N writes the same problems as plain text for a base model without a chat template (Gemma 3
270M, colo.gemma3): N solved problems, one a line ("9 * 4 = 36"), then the question ("1 * 13 =").
The model writes its answer and then problems of its own, so `first_number` is the reward (`--reward
colo.grpo.arithmetic:first_number`): the math reward would read the last of them.
"""
from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

SYSTEM = "Answer with the number only."


def _problem(rng: random.Random) -> tuple[int, int, bool]:
    """Two numbers from 1 to 20 and whether they are added (else multiplied)."""
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    return a, b, rng.random() < 0.5


def problems(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b, plus = _problem(rng)
        if plus:
            question, answer = f"What is {a} + {b}?", a + b
        else:
            question, answer = f"What is {a} times {b}?", a * b
        rows.append({"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                     "answer": str(answer)})
    return rows


def few_shot(count: int, seed: int, shots: int) -> list[dict]:
    """The same problems as plain-text prompts: `shots` solved ones, one a line, then the question."""
    rng = random.Random(seed)

    def line() -> tuple[str, int]:
        a, b, plus = _problem(rng)
        return (f"{a} + {b} =", a + b) if plus else (f"{a} * {b} =", a * b)

    rows = []
    for _ in range(count):
        solved = [f"{question} {answer}" for question, answer in (line() for _ in range(shots))]
        question, answer = line()
        rows.append({"prompt": "\n".join([*solved, question]), "answer": str(answer)})
    return rows


def first_number(completions, answer, **kwargs) -> list[float]:
    """1.0 where the first number in the completion is the `answer` column's: a base model continuing a
    few-shot prompt writes its answer, then more problems of its own."""
    from .rewards import completion_text

    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        number = re.search(r"-?\d+", completion_text(completion))
        rewards.append(float(number is not None and number.group() == str(gold)))
    return rewards


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
          show_call: bool = False, shots: int = 0) -> tuple[Path, Path]:
    """Write DIR/train.jsonl and DIR/eval.jsonl (disjoint seeds) and return their paths; shots > 0: the
    plain-text few-shot prompts."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, count, offset in (("train", train, 0), ("eval", eval, 1)):
        path = directory / f"{name}.jsonl"
        if tool_sums_task:
            rows = tool_sums(count, seed * 2 + offset, show_call)
        elif shots:
            rows = few_shot(count, seed * 2 + offset, shots)
        else:
            rows = problems(count, seed * 2 + offset)
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        paths.append(path)
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m colo.grpo.arithmetic", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--train", type=int, default=256)
    parser.add_argument("--eval", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tool-sums", action="store_true", help="4-5 digit sums, for the add tool")
    parser.add_argument("--show-call", action="store_true", help="with --tool-sums: a demonstrated call before each question")
    parser.add_argument("--few-shot", type=int, default=0, metavar="N",
                        help="plain-text prompts for a base model: N solved problems, then the question")
    args = parser.parse_args(argv)
    if args.few_shot < 0 or (args.few_shot and args.tool_sums):
        parser.error("--few-shot takes N >= 1 and does not go with --tool-sums")
    for path in write(args.directory, args.train, args.eval, args.seed, args.tool_sums, args.show_call, args.few_shot):
        print(path)


if __name__ == "__main__":
    main()
