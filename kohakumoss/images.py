"""Contact sheets: images in a grid, each captioned with its label (previews, `kmoss sample`)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

from PIL import Image, ImageDraw


MIN_CELL = 192  # pixels: a cell at least this wide, so a small preview's label stays legible
LINE = 12  # pixels per label line (PIL's default bitmap font)
CHAR = 6  # its pixels per character
MAX_LINES = 4


def label_lines(label: str, width: int) -> list[str]:
    """``label`` wrapped to ``width`` pixels, at most ``MAX_LINES`` lines (the last ends in
    "..." when cut)."""
    lines = textwrap.wrap(label, max(8, width // CHAR - 1)) or [""]
    if len(lines) > MAX_LINES:
        lines = lines[:MAX_LINES]
        lines[-1] = lines[-1][: max(0, len(lines[-1]) - 3)] + "..."
    return lines


def contact_sheet(images: Sequence[Image.Image], labels: Sequence[str], columns: int | None = None
                  ) -> Image.Image:
    """Images in a grid, each with its whole label above it (wrapped to the cell)."""
    columns = columns or max(1, math.ceil(math.sqrt(len(images))))
    rows = math.ceil(len(images) / columns)
    w = max(MIN_CELL, max(im.width for im in images))
    h = max(im.height for im in images)
    wrapped = [label_lines(label, w) for label in labels]
    band = LINE * max(len(lines) for lines in wrapped) + 4
    sheet = Image.new("RGB", (columns * w, rows * (h + band)), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (im, lines) in enumerate(zip(images, wrapped)):
        x, y = (i % columns) * w, (i // columns) * (h + band)
        sheet.paste(im, (x + (w - im.width) // 2, y + band))
        draw.multiline_text((x + 2, y + 1), "\n".join(lines), fill="black", spacing=0)
    return sheet
