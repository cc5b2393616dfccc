"""Opening and probing image files safely: a header that declares a decompression bomb is
refused before any pixel is decoded, EXIF orientation is applied to the probed size, and an
optional verify pass decodes the data once so a truncated file is found at scan time."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from typing import Any

from PIL import Image, UnidentifiedImageError

from kohakumoss.data.rows import MAX_IMAGE_PIXELS

ALPHA_MODES = {"RGBA", "LA", "PA", "RGBa", "La"}
EXIF_ORIENTATION = 0x0112


@contextlib.contextmanager
def open_image(fp: str | os.PathLike | io.BytesIO | Any, max_pixels: int) -> Iterator[Image.Image]:
    """``Image.open`` that refuses a header declaring more than ``max_pixels`` pixels (a
    decompression bomb) with a ``ValueError`` naming the size, before any pixel is decoded.

    PIL's own process-wide check (a warning above ``Image.MAX_IMAGE_PIXELS``, an error above
    twice that) is raised, never lowered, to agree: with the default ``max_pixels`` it
    stays PIL's default.
    """
    if Image.MAX_IMAGE_PIXELS is not None and 2 * Image.MAX_IMAGE_PIXELS < max_pixels:
        Image.MAX_IMAGE_PIXELS = (max_pixels + 1) // 2
    try:
        im = Image.open(fp)
    except Image.DecompressionBombError as e:
        raise ValueError(f"a decompression bomb: {e} (data.max_image_pixels = "
                         f"{max_pixels:,}; raise it if the image is real)") from None
    with im:
        w, h = im.size
        if w * h > max_pixels:
            raise ValueError(f"a decompression bomb: the header declares {w}x{h} = {w * h:,} "
                             f"pixels, above data.max_image_pixels = {max_pixels:,} (raise it "
                             "if the image is real)")
        yield im


def check_image_data(im: Image.Image) -> None:
    """Decode the image once so a truncated or corrupt file fails now: a JPEG at 1/8 scale
    (every coefficient is still read), anything else in full (a PNG's EXIF lookup decodes
    it anyway). ``im.size`` may shrink: read it first."""
    im.draft(im.mode, (max(1, im.width // 8), max(1, im.height // 8)))  # JPEG only
    im.load()


def probe_image(fp: str | os.PathLike | io.BytesIO | Any, max_pixels: int = MAX_IMAGE_PIXELS,
                verify: bool = False) -> tuple[int, int, bool]:
    """(w, h, has_alpha) after EXIF orientation, from the header; ``verify`` then reads the
    image data once (``check_image_data``) without keeping it.

    Raises ``ValueError`` with the reason for an unreadable or oversized file.
    """
    try:
        with open_image(fp, max_pixels) as im:
            w, h = im.size
            mode = im.mode
            alpha = mode in ALPHA_MODES or (mode == "P" and "transparency" in im.info)
            if verify:
                try:
                    check_image_data(im)
                except Exception as e:  # whatever a decoder raises on hostile bytes
                    raise ValueError(f"truncated or corrupt image data ({e})") from None
            try:
                orientation = im.getexif().get(EXIF_ORIENTATION, 1)
            except Exception:  # a broken EXIF block does not make the image unusable
                orientation = 1
    except UnidentifiedImageError:
        raise ValueError("not a recognised image format") from None
    except (OSError, SyntaxError) as e:
        raise ValueError(f"unreadable image header ({e})") from None
    if w <= 0 or h <= 0:
        raise ValueError(f"image has an empty size {w}x{h}")
    if orientation in (5, 6, 7, 8):
        w, h = h, w
    return w, h, alpha
