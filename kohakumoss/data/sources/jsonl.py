"""The ``jsonl`` source: a JSON-lines manifest of image records (``docs/data.md#jsonl``).

One record per non-empty line. The image path is the first present key of ``image``,
``file``, ``path``, ``file_name`` (relative to ``root``, default the manifest's folder);
``weight`` and ``group`` are popped and the rest goes through the JSON mapping
(``docs/data.md#sidecars-and-json-metadata``).
Walk keys are ``<locator>#<n>`` (n = earlier occurrences of that locator), stamps
``(size, mtime_ns, line hash, 0, -1, -1, -1, -1)``. Each line is decoded on its own under
``data.caption_errors``: a line that is not UTF-8 is a rejected record (skip), U+FFFD text
with a warning (replace) or a failed scan (strict).
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

from kohakumoss.data.rows import ScanLimits, WalkItem
from kohakumoss.data.sources.base import (
    SourceError,
    check_args,
    decode_caption,
    error_rows,
    line_hash,
    pad_stamp,
    probe_file,
    register_source,
    relative_locator,
    stat_or_lstat,
)

IMAGE_KEYS = ("image", "file", "path", "file_name")


def pop_weight_group(record: dict[str, Any], where: str) -> tuple[float, str]:
    """Pop ``weight`` (default 1.0) and ``group`` (default "") from a manifest record;
    null means the default. Shared with the parquet source."""
    weight = record.pop("weight", None)
    group = record.pop("group", None)
    if weight is None:
        weight = 1.0
    elif isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise SourceError(f"{where}: weight must be a number, got {weight!r}")
    return float(weight), "" if group is None else str(group)


def manifest_item(abs_root: Path, locator: str, seen: dict[str, int], extra_stamp: int,
                  weight: float, group: str, meta: dict[str, Any], hash_content: bool,
                  limits: ScanLimits, warnings: list[str], error: str | None) -> WalkItem:
    """The walk item of one manifest record (jsonl line or parquet path-mode row); a record
    with an ``error`` (text that is not UTF-8, under skip) is a rejected row."""
    n = seen.get(locator, 0)
    seen[locator] = n + 1
    image = abs_root / locator
    size, mtime = stat_or_lstat(image)
    if error is not None:
        probe = functools.partial(error_rows, locator, error, group=group, weight=weight)
    else:
        probe = functools.partial(probe_file, str(image), locator, group=group, weight=weight,
                                  meta=meta, hash_content=hash_content, limits=limits,
                                  warnings=tuple(warnings))
    return WalkItem(f"{locator}#{n}", pad_stamp(size, mtime, extra_stamp, 0), probe)


@register_source("jsonl")
@dataclasses.dataclass(frozen=True)
class JsonlSource:
    path: str
    root: str | None = None
    hash_content: bool = False

    def __post_init__(self) -> None:
        check_args(self)

    def image_root(self) -> Path:
        return Path(self.root) if self.root is not None else Path(self.path).parent

    def walk(self, limits: ScanLimits = ScanLimits()) -> list[WalkItem]:
        manifest = Path(self.path)
        if not manifest.is_file():
            raise SourceError(f"jsonl source: manifest {str(manifest)!r} does not exist "
                              f"(resolved to {str(manifest.absolute())!r}); set path to a "
                              '.jsonl file with one {"image": "a.png", ...} record per line')
        abs_root = self.image_root().absolute()
        data = manifest.read_bytes().removeprefix(codecs.BOM_UTF8)
        items: list[WalkItem] = []
        seen: dict[str, int] = {}
        for lineno, raw in enumerate(data.split(b"\n"), 1):  # not splitlines: JSON may hold U+2028
            where = f"{manifest}:{lineno}"
            notes: list[str] = []
            error = None
            try:
                line = decode_caption(raw, where, limits.caption_errors, notes).strip()
            except ValueError as e:  # caption_errors: skip; the record is still named
                line, error = raw.decode("utf-8", errors="replace").strip(), str(e)
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise SourceError(f"{where}: not valid JSON ({e}); each line must be one "
                                  "JSON object") from None
            if not isinstance(record, dict):
                raise SourceError(f"{where}: each line must be a JSON object, got "
                                  f"{type(record).__name__}")
            key = next((k for k in IMAGE_KEYS if record.get(k) is not None), None)
            if key is None:
                raise SourceError(f"{where}: no image path; give one of the keys "
                                  f"{', '.join(IMAGE_KEYS)} (relative to {str(abs_root)!r})")
            locator = relative_locator(record.pop(key))
            weight, group = pop_weight_group(record, where)
            items.append(manifest_item(abs_root, locator, seen, line_hash(line), weight, group,
                                       record, self.hash_content, limits, notes, error))
        return items

    def open(self, locator: str) -> bytes:
        return (self.image_root() / locator).read_bytes()

    def own_catalog(self) -> Path | None:
        return None
