"""The ``jsonl`` source: a JSON-lines manifest of image records (``spec/data.md`` 3.3).

One record per non-empty line. The image path is the first present key of ``image``,
``file``, ``path``, ``file_name`` (relative to ``root``, default the manifest's folder);
``weight`` and ``group`` are popped and the rest goes through the JSON mapping (2.1).
Walk keys are ``<locator>#<n>`` (n = earlier occurrences of that locator), stamps
``(size, mtime_ns, line hash, 0, -1, -1, -1, -1)``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

from kohakumoss.data.rows import WalkItem
from kohakumoss.data.sources.base import (
    SourceError,
    check_args,
    line_hash,
    pad_stamp,
    probe_file,
    register_source,
    relative_locator,
    stat_pair,
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
                  weight: float, group: str, meta: dict[str, Any], hash_content: bool
                  ) -> WalkItem:
    """The walk item of one manifest record (jsonl line or parquet path-mode row)."""
    n = seen.get(locator, 0)
    seen[locator] = n + 1
    image = abs_root / locator
    size, mtime = stat_pair(image)
    probe = functools.partial(probe_file, str(image), locator, group=group, weight=weight,
                              meta=meta, hash_content=hash_content)
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

    def walk(self) -> list[WalkItem]:
        manifest = Path(self.path)
        if not manifest.is_file():
            raise SourceError(f"jsonl source: manifest {str(manifest)!r} does not exist "
                              f"(resolved to {str(manifest.absolute())!r}); set path to a "
                              '.jsonl file with one {"image": "a.png", ...} record per line')
        abs_root = self.image_root().absolute()
        text = manifest.read_bytes().decode("utf-8-sig", errors="replace")
        items: list[WalkItem] = []
        seen: dict[str, int] = {}
        for lineno, raw in enumerate(text.split("\n"), 1):  # not splitlines: JSON may hold U+2028
            line = raw.strip()
            if not line:
                continue
            where = f"{manifest}:{lineno}"
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
                                       record, self.hash_content))
        return items

    def open(self, locator: str) -> bytes:
        return (self.image_root() / locator).read_bytes()

    def own_catalog(self) -> Path | None:
        return None
