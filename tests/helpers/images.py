"""Images the vision-language tests draw themselves: white 56 x 56 (the tiny Idefics3's size) with
`count` black squares in a row."""
from __future__ import annotations


def squares(count: int):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (56, 56), "white")
    draw = ImageDraw.Draw(image)
    for k in range(count):
        draw.rectangle([4 + 12 * k, 20, 12 + 12 * k, 30], fill="black")
    return image
