"""Contact sheets: images in a grid, each captioned with its label (previews, `kmoss sample`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from PIL import Image, ImageDraw


def contact_sheet(images: Sequence[Image.Image], labels: Sequence[str], columns: int | None = None
                  ) -> Image.Image:
    """Images in a grid, each captioned with its label."""
    columns = columns or max(1, math.ceil(math.sqrt(len(images))))
    rows = math.ceil(len(images) / columns)
    w = max(im.width for im in images)
    h = max(im.height for im in images)
    sheet = Image.new("RGB", (columns * w, rows * (h + 14)), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (im, label) in enumerate(zip(images, labels)):
        x, y = (i % columns) * w, (i // columns) * (h + 14)
        sheet.paste(im, (x, y + 14))
        draw.text((x + 2, y + 1), label[: max(8, w // 6)], fill="black")
    return sheet
