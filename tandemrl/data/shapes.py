"""Built-in visual tasks for a tiny vision-language model on CPU, drawn with Pillow.

- ``builtin://shape-colour``: a 28 x 28 image with one filled square or disc (9-20 pixels
  across, anywhere) in one of four colours on black, and the text ``colour=``; the answer is
  the colour's letter: ``r`` red, ``g`` green, ``b`` blue, ``y`` yellow.
- ``builtin://count-squares``: the counting variant below.

``builtin://count-squares``: each prompt is a 28 x 28 image with 1 to 4 coloured squares on black and the text
``squares=``; the answer is their number (``"3"``). The image is cut into a 4 x 4 grid of
7-pixel cells (the tiny VLM's patches); each square is 5 x 5 pixels at a random offset inside
its own cell, so squares never touch and the count is the number of cells with a square.
Colours and cells are drawn from ``random.Random(seed)``, so every run gets the same list.

The image travels in the record as a PNG data URI under ``image`` (the default
``data.image_key``), exactly as a JSONL row would carry it; Pillow draws it. The text alone
says nothing about the answer: a model that ignores the image scores at most 0.25 (always
the same count).
"""

from __future__ import annotations

import base64
import io
import random
from typing import Any

from PIL import Image, ImageDraw

IMAGE_SIZE = 28
CELL = 7
SQUARE = 5
MAX_SQUARES = 4
PROMPT = "squares="
COLOURS = ((230, 60, 50), (60, 200, 80), (70, 110, 240), (235, 220, 60))
COLOUR_LETTERS = "rgby"  # the answer for each of COLOURS
COLOUR_PROMPT = "colour="


def draw_squares(rng: random.Random, count: int) -> Image.Image:
    """A 28 x 28 RGB image with ``count`` squares in distinct grid cells."""
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (0, 0, 0))
    draw = ImageDraw.Draw(image)
    cells_per_side = IMAGE_SIZE // CELL
    for cell in rng.sample(range(cells_per_side * cells_per_side), count):
        left = (cell % cells_per_side) * CELL + rng.randrange(CELL - SQUARE + 1)
        top = (cell // cells_per_side) * CELL + rng.randrange(CELL - SQUARE + 1)
        draw.rectangle([left, top, left + SQUARE - 1, top + SQUARE - 1], fill=rng.choice(COLOURS))
    return image


def png_data_uri(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def count_squares_rows(num_prompts: int, seed: int) -> list[dict[str, Any]]:
    """``num_prompts`` rows ``{"prompt", "answer", "image"}`` from ``random.Random(seed)``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        count = rng.randint(1, MAX_SQUARES)
        rows.append(
            {
                "prompt": PROMPT,
                "answer": str(count),
                "image": png_data_uri(draw_squares(rng, count)),
            }
        )
    return rows


def draw_shape(rng: random.Random, colour: tuple[int, int, int]) -> Image.Image:
    """A 28 x 28 RGB image with one filled square or disc of ``colour`` on black."""
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (0, 0, 0))
    size = rng.randint(9, 20)
    left, top = rng.randrange(IMAGE_SIZE - size + 1), rng.randrange(IMAGE_SIZE - size + 1)
    box = [left, top, left + size - 1, top + size - 1]
    draw = ImageDraw.Draw(image)
    if rng.random() < 0.5:
        draw.rectangle(box, fill=colour)
    else:
        draw.ellipse(box, fill=colour)
    return image


def shape_colour_rows(num_prompts: int, seed: int) -> list[dict[str, Any]]:
    """``num_prompts`` rows ``{"prompt", "answer", "image"}`` from ``random.Random(seed)``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        index = rng.randrange(len(COLOURS))
        image = draw_shape(rng, COLOURS[index])
        rows.append(
            {"prompt": COLOUR_PROMPT, "answer": COLOUR_LETTERS[index], "image": png_data_uri(image)}
        )
    return rows
