"""A small arithmetic dataset for the README's worked example and the tests: chat prompts asking for
the sum or product of two small numbers, with the answer in an `answer` column (the `math` reward
reads it). Written offline, seeded, in TRL's conventions.

    python -m colo.grpo.arithmetic DIR [--train N] [--eval N] [--seed S]   # DIR/train.jsonl, DIR/eval.jsonl
"""
from __future__ import annotations

import argparse
import json
import random
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


def write(directory: str | Path, train: int = 256, eval: int = 32, seed: int = 0) -> tuple[Path, Path]:
    """Write DIR/train.jsonl and DIR/eval.jsonl (disjoint seeds) and return their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, count, offset in (("train", train, 0), ("eval", eval, 1)):
        path = directory / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in problems(count, seed * 2 + offset)))
        paths.append(path)
    return paths[0], paths[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m colo.grpo.arithmetic", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--train", type=int, default=256)
    parser.add_argument("--eval", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for path in write(args.directory, args.train, args.eval, args.seed):
        print(path)
