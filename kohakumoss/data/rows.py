"""The row model every source produces (``spec/data.md`` section 2).

A source enumerates ``WalkItem``s cheaply (stat only); ``WalkItem.probe()`` reads image
headers and returns the item's ``Row``s (one for a file, many for a container). The
catalog assigns ids; sources never do.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".jxl", ".avif")
STAMP_LEN = 8
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


def split_tags(text: str) -> list[str]:
    """Split a tag line on ',', strip each piece, drop empty ones (``spec/data.md`` 4.1)."""
    return [t.strip() for t in text.split(",") if t.strip()]
