"""The row model every source produces (``docs/data.md#the-row-model``).

A source enumerates ``WalkItem``s cheaply (stat only); ``WalkItem.probe()`` reads image
headers and returns the item's ``Row``s (one for a file, many for a container). The
catalog assigns ids; sources never do. ``ScanLimits`` is what a probe accepts (the
``data`` knobs against hostile files); ``cap_captions`` applies the caption-length cap.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from kohakumoss.config import MAX_CAPTION_CHARS, MAX_IMAGE_PIXELS  # noqa: F401 (re-exported)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".jxl", ".avif")
STAMP_LEN = 10  # the image, its .txt, .caption, .json and .mask.png: (size, mtime_ns) each
MISSING = (-1, -1)



@dataclasses.dataclass
class Row:
    """One image record. ``w``/``h`` are after EXIF orientation.

    ``error`` is set (and the size fields are 0) for an image that could not be probed:
    the catalog keeps it as a rejected row so the scan report lists it and an unchanged
    broken file is not probed again.
    """

    locator: str
    w: int = 0
    h: int = 0
    has_alpha: bool = False
    group: str = ""
    weight: float = 1.0
    tags: list[str] | None = None
    caption_nl: str | None = None
    artist: str | None = None
    rating: str | None = None
    json: dict[str, Any] | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)  # this probe's; not catalogued


@dataclasses.dataclass(frozen=True)
class ScanLimits:
    """What a probe accepts: ``data.max_caption_chars``, ``data.caption_errors`` (skip /
    replace / strict for captions that are not UTF-8), ``data.max_image_pixels`` (checked on
    the header, before any decode) and ``data.verify_images`` (read all image data once)."""

    max_caption_chars: int = MAX_CAPTION_CHARS
    caption_errors: str = "skip"
    max_image_pixels: int = MAX_IMAGE_PIXELS
    verify_images: bool = True


@dataclasses.dataclass(frozen=True)
class WalkItem:
    """A unit of change detection: a stable ``key``, an 8-int ``stamp`` of file stats
    (-1 = absent) that changes when the item changes, and ``probe`` returning its rows.

    ``probe`` must be picklable (a module-level function bound with ``functools.partial``)
    so catalogs can probe on a process pool.
    """

    key: str
    stamp: tuple[int, ...]
    probe: Callable[[], list[Row]]


def caption_char_counts(row: Row) -> tuple[int, int, int, int, int]:
    """(tags, nl, artist, rating, json) character counts used by the caption estimate."""
    tags = len(", ".join(row.tags)) if row.tags else 0
    nl = len(row.caption_nl) if row.caption_nl else 0
    artist = len(row.artist) if row.artist else 0
    rating = len(row.rating) if row.rating else 0
    js = len(json.dumps(row.json, ensure_ascii=False, separators=(",", ":"))) if row.json else 0
    return tags, nl, artist, rating, js


def _json_len(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def _cap_tags(tags: list[str], max_chars: int) -> list[str]:
    """The leading tags whose ``", "``-joined length fits (a first tag alone too long is cut)."""
    kept: list[str] = []
    used = 0
    for tag in tags:
        used += len(tag) + (2 if kept else 0)
        if used > max_chars:
            return kept or [tag[:max_chars]]
        kept.append(tag)
    return kept


def _cap_json(meta: dict[str, Any], max_chars: int) -> dict[str, Any]:
    """The leading fields whose compact JSON fits; the first string value that does not fit
    is cut to the room left (so one huge description still gives its beginning)."""
    kept: dict[str, Any] = {}
    used = 2  # the braces
    for key, value in meta.items():
        head = _json_len(key) + 1 + (1 if kept else 0)  # "key": and a comma
        if used + head + _json_len(value) <= max_chars:
            kept[key] = value
            used += head + _json_len(value)
            continue
        if isinstance(value, str):  # the longest prefix that fits (escapes count double)
            room, lo, hi = max_chars - used - head, 0, len(value)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if _json_len(value[:mid]) <= room else (lo, mid - 1)
            if lo:
                kept[key] = value[:lo]
        break
    return kept


def cap_captions(row: Row, max_chars: int) -> None:
    """Cut each caption field of ``row`` (tags joined, caption_nl, artist, rating, the JSON
    metadata) to ``max_chars`` characters as ``caption_char_counts`` counts them, noting
    every cut in ``row.warnings``."""
    counts = dict(zip(("tags", "caption_nl", "artist", "rating", "json"), caption_char_counts(row)))
    for field, n in counts.items():
        if n <= max_chars:
            continue
        value = getattr(row, field)
        if field == "tags":
            value = _cap_tags(value, max_chars)
        elif field == "json":
            value = _cap_json(value, max_chars)
        else:
            value = value[:max_chars]
        setattr(row, field, value)
        row.warnings.append(f"{field} has {n:,} characters, above data.max_caption_chars = "
                            f"{max_chars:,}: cut to fit")


def split_tags(text: str) -> list[str]:
    """Split a tag line on ',', strip each piece, drop empty ones
    (``docs/data.md#tag-utilities``)."""
    return [t.strip() for t in text.split(",") if t.strip()]
