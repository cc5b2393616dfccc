"""Cache keys (``docs/encoders.md#cache-keys``, ``docs/data.md#image-identity``).

``text_hash(*parts)`` is blake2b-128 hex over the UTF-8 of the parts (each through ``str``)
joined by the unit separator. A key names exactly what was encoded and how: change the
encoder, its compute dtype or precision, the storage dtype or any part of the input, and
the key changes, so a stale entry can never be read.
"""

from __future__ import annotations

import hashlib
from typing import Any

SEP = "\x1f"


def text_hash(*parts: Any) -> str:
    return hashlib.blake2b(SEP.join(str(p) for p in parts).encode("utf-8"), digest_size=16).hexdigest()


def text_key(encoder_key_id: str, storage: str, caption: str) -> str:
    return text_hash("text", encoder_key_id, storage, caption)


def content_identity(extra_hash: str | None, locator: str, w: int, h: int) -> str:
    """The row's content hash when its source has one, else ``locator:WxH``."""
    return extra_hash if extra_hash else f"{locator}:{w}x{h}"


def latent_key(content: str, encoder_key_id: str, storage: str, target_hw: tuple[int, int],
               crop_ltrb: tuple[int, int, int, int], flip: bool, background: str, has_alpha: bool,
               resample: str, draw: str) -> str:
    return text_hash("latent", content, encoder_key_id, storage, tuple(int(v) for v in target_hw),
                     tuple(int(v) for v in crop_ltrb), int(flip), background if has_alpha else "",
                     resample, draw)


def mask_key(latent: str, kind: str, identity: str) -> str:
    """A loss mask's entry (``data.masks``): the latent entry it belongs to (the same crop,
    size, flip and storage) and the mask's own content (a sidecar file's hash)."""
    return text_hash("mask", latent, kind, identity)


def background_name(bg: str | tuple[int, int, int]) -> str:
    return bg if isinstance(bg, str) else "({}, {}, {})".format(*bg)
