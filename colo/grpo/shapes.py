"""A task with images drawn by the task itself, for vision-language GRPO (docs/vision.md): "how many
squares?" over white 56x56 images of 1 to 4 black squares at random places. It writes the dataset as
TRL's columns: a chat `prompt`, an `image` (a PNG path) and the `answer`, scored by the `gsm8k` reward
(the completion's last number against the answer).

    python -m colo.grpo.shapes shapes/ --train 64 --eval 16
    python -m colo.bench.vision_models tiny-vlm/
    python -m colo.grpo --model tiny-vlm/ --dataset shapes/train.jsonl --reward gsm8k ...
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

QUESTION = "How many squares are in the image? Answer with a number."
SIDE = 56      # pixels: the tiny model's image size (colo.bench.vision_models)
SQUARE = 10


def draw(count: int, rng: random.Random):
    """A white image with `count` black squares that do not overlap."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIDE, SIDE), "white")
    pen = ImageDraw.Draw(image)
    cells = rng.sample([(x, y) for x in range(4) for y in range(4)], count)   # a 4 x 4 grid of 14-pixel cells
    for x, y in cells:
        left, top = 14 * x + rng.randint(0, 14 - SQUARE), 14 * y + rng.randint(0, 14 - SQUARE)
        pen.rectangle([left, top, left + SQUARE - 1, top + SQUARE - 1], fill="black")
    return image


def write_split(directory: Path, name: str, rows: int, rng: random.Random) -> Path:
    images = directory / "images"
    images.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.jsonl"
    with path.open("w") as out:
        for i in range(rows):
            count = rng.randint(1, 4)
            image_path = images / f"{name}-{i:05d}.png"
            draw(count, rng).save(image_path)
            out.write(json.dumps({"prompt": [{"role": "user", "content": QUESTION}], "image": str(image_path.resolve()),
                                  "answer": str(count)}) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m colo.grpo.shapes", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--train", type=int, default=64)
    parser.add_argument("--eval", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    directory = Path(args.directory)
    for name, rows in (("train", args.train), ("eval", args.eval)):
        print(write_split(directory, name, rows, rng))


if __name__ == "__main__":
    main()
