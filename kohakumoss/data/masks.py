"""Loss masks (``docs/training.md#masked-loss``): which pixels of an image the flow loss
counts, one weight in [0, 1] per latent token.

A dataset entry's ``mask:`` picks the source: ``file`` (kohya's ``img.mask.png`` beside the
image, white = counted), ``alpha`` (the image's own alpha channel), ``auto`` (the file where
there is one, else the alpha channel where the image has one), ``off`` (the default: every
token counts). An image that has no mask of the chosen kind trains unmasked.

The mask follows the sample exactly as its pixels do: the same EXIF orientation, crop box,
resize to the planned size and flip; then each 16x16 pixel patch (one latent token) becomes
the mean of its values, in the tokens' row-major order. The cache stage stores it beside the
latents (``cache.keys.mask_key``: the latent entry's key and the mask's content), so a
changed mask file is a new entry and a resumed run reads what it trained on.
"""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image, ImageOps

from kohakumoss.config import MASK_MODES  # noqa: F401 (the choices, beside DatasetEntry)
from kohakumoss.data.sources.images import open_image

PATCH = 16  # pixels a side of one latent token


def mask_source(mode: str, extra: dict, has_alpha: bool) -> tuple[str, str] | None:
    """(kind, identity) of a catalog row's mask under ``mode``, or None: unmasked."""
    if mode in ("file", "auto") and extra.get("mask"):
        return "file", str(extra["mask"])
    if mode in ("alpha", "auto") and has_alpha:
        return "alpha", ""
    return None


def mask_path(image_locator: str) -> str:
    """The sidecar mask's locator beside an image's (``dir/img.png`` -> ``dir/img.mask.png``)."""
    from kohakumoss.data.sources.base import MASK_SUFFIX

    head, _, name = image_locator.rpartition("/")
    stem = name.rsplit(".", 1)[0]
    return f"{head}/{stem}{MASK_SUFFIX}" if head else f"{stem}{MASK_SUFFIX}"


def mask_tokens(kind: str, image: bytes, mask: bytes | None, box: tuple[int, int, int, int],
                target_hw: tuple[int, int], flip: bool, max_pixels: int, where: str = "the image"
                ) -> torch.Tensor:
    """float32 ``[h/16 * w/16]``: the mask of one planned sample at token resolution.
    ``kind`` ``file`` reads ``mask`` (a grayscale or RGB PNG of the image's size), ``alpha``
    the alpha channel of ``image``. A mask whose size differs from its image's is an error
    naming it."""
    with open_image(io.BytesIO(image), max_pixels) as im:
        im = ImageOps.exif_transpose(im)
        size = im.size
        if kind == "alpha":
            plane = im.convert("RGBA").getchannel("A")
    if kind == "file":
        if mask is None:
            raise ValueError(f"the loss mask of {where} is missing")
        with open_image(io.BytesIO(mask), max_pixels) as m:
            m = ImageOps.exif_transpose(m)
            if m.size != size:
                raise ValueError(f"the loss mask of {where} is {m.size[0]}x{m.size[1]}, the image "
                                 f"{size[0]}x{size[1]}: save the mask at the image's size")
            plane = m.convert("L")
    th, tw = target_hw
    plane = plane.crop(box)
    if plane.size != (tw, th):
        plane = plane.resize((tw, th), Image.Resampling.BILINEAR)
    if flip:
        plane = plane.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    values = torch.from_numpy(np.asarray(plane, dtype=np.float32) / 255.0)
    h, w = th // PATCH, tw // PATCH
    return values.reshape(h, PATCH, w, PATCH).mean(dim=(1, 3)).reshape(-1).contiguous()
