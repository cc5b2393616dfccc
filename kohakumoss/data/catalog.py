"""The incremental per-source catalog, stored as one Parquet file per dataset entry.

``docs/data.md#the-catalog`` describes the behaviour this keeps: rows carry the walk item
they came from and its stamp; a re-scan probes only new items and items whose stamp
changed, rewrites a changed item's rows in place when the row count is unchanged (ids
stay stable), otherwise tombstones the old ids and appends; items that disappeared are
tombstoned. Ids are never reused. Images that could not be probed stay as rejected rows
(``live`` false, ``error`` set) so the scan report lists them and an unchanged broken file
is not probed again. A probe's warnings (a capped caption, a caption decoded with U+FFFD)
are reported by the scan that read the file; they are not stored.

Column legend: ``id`` row id inside this catalog; ``item`` walk key; ``stamp`` 8 ints;
``w``/``h`` oriented pixel size; ``*_chars`` caption length columns
(``docs/data.md#caption-length-estimates``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kohakumoss.artifacts import atomic_path
from kohakumoss.data.rows import (STAMP_LEN, Row, ScanLimits, WalkItem, cap_captions,
                                  caption_char_counts)
from kohakumoss.errors import KohakuError

SCHEMA_VERSION = 2  # 2: the stamp holds the loss mask sidecar too (an older catalog is rescanned whole)
CHAR_COLUMNS = ("tags_chars", "nl_chars", "artist_chars", "rating_chars", "json_chars")

CATALOG_SCHEMA = pa.schema([
    ("id", pa.int64()),
    ("item", pa.string()),
    ("stamp", pa.list_(pa.int64(), STAMP_LEN)),
    ("live", pa.bool_()),
    ("locator", pa.string()),
    ("w", pa.int32()),
    ("h", pa.int32()),
    ("has_alpha", pa.bool_()),
    ("group", pa.string()),
    ("weight", pa.float32()),
    ("tags", pa.list_(pa.string())),
    ("caption_nl", pa.string()),
    ("artist", pa.string()),
    ("rating", pa.string()),
    ("json", pa.string()),
    ("extra", pa.string()),
    ("error", pa.string()),
    *[(c, pa.int32()) for c in CHAR_COLUMNS],
])


class CatalogError(KohakuError, RuntimeError):
    """An unreadable catalog file or a catalog of another layout."""


def catalog_name(source_name: str, args: dict[str, Any]) -> str:
    """``<source>-<digest>.parquet``: digest of the source's own arguments, paths made absolute."""
    canon = {"source": source_name}
    for k, v in args.items():
        if k in ("path", "root") and isinstance(v, str) and "*" not in v:
            v = os.path.abspath(v)
        canon[k] = v
    text = json.dumps(canon, sort_keys=True, separators=(",", ":"), default=str)
    return f"{source_name}-{hashlib.sha1(text.encode()).hexdigest()[:16]}.parquet"


def _row_record(row: Row, rid: int, item: str, stamp: Sequence[int], live: bool) -> dict[str, Any]:
    chars = caption_char_counts(row) if row.error is None else (0, 0, 0, 0, 0)
    rec = {
        "id": rid, "item": item, "stamp": list(stamp), "live": live and row.error is None,
        "locator": row.locator, "w": row.w, "h": row.h, "has_alpha": row.has_alpha,
        "group": row.group, "weight": row.weight if row.error is None else 0.0,
        "tags": row.tags, "caption_nl": row.caption_nl, "artist": row.artist,
        "rating": row.rating,
        "json": json.dumps(row.json, ensure_ascii=False, sort_keys=True) if row.json else None,
        "extra": json.dumps(row.extra, ensure_ascii=False, sort_keys=True),
        "error": row.error,
    }
    rec.update(zip(CHAR_COLUMNS, chars))
    return rec


def row_from_record(rec: dict[str, Any]) -> Row:
    """The ``Row`` of one catalog record (as given by ``Table.to_pylist``)."""
    return Row(locator=rec["locator"], w=rec["w"], h=rec["h"], has_alpha=rec["has_alpha"],
               group=rec["group"], weight=rec["weight"], tags=rec["tags"],
               caption_nl=rec["caption_nl"], artist=rec["artist"], rating=rec["rating"],
               json=json.loads(rec["json"]) if rec["json"] else None,
               extra=json.loads(rec["extra"]) if rec["extra"] else {}, error=rec["error"])


def _table(records: list[dict[str, Any]], generation: int, kind: str) -> pa.Table:
    meta = {"kohakumoss.catalog": json.dumps({"schema": SCHEMA_VERSION, "generation": generation,
                                              "kind": kind})}
    return pa.Table.from_pylist(records, schema=CATALOG_SCHEMA.with_metadata(meta))


def write_catalog(path: Path, table: pa.Table) -> None:
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def write_rows_catalog(path: Path, rows: list[Row], kind: str = "moss_shard") -> None:
    """A fresh catalog of ``rows`` (ids 0..n-1, the locator as item key, no stamps)."""
    records = [_row_record(r, i, r.locator, [-1] * STAMP_LEN, True) for i, r in enumerate(rows)]
    write_catalog(Path(path), _table(records, 1, kind))


def catalog_info(table: pa.Table) -> dict[str, Any]:
    raw = (table.schema.metadata or {}).get(b"kohakumoss.catalog")
    return json.loads(raw) if raw else {}


def read_catalog(path: Path) -> pa.Table:
    """Read a catalog file; a file of another layout is a ``CatalogError``."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as e:
        raise CatalogError(f"catalog {path} is unreadable ({e}); delete it to rebuild") from None
    info = catalog_info(table)
    if info.get("schema") != SCHEMA_VERSION or not table.schema.equals(CATALOG_SCHEMA,
                                                                       check_metadata=False):
        raise CatalogError(f"catalog {path} has another layout (schema {info.get('schema')!r}, "
                           f"expected {SCHEMA_VERSION}); delete it to rebuild")
    return table


@dataclasses.dataclass
class ScanStats:
    items: int = 0
    cached: int = 0
    new: int = 0
    changed: int = 0
    removed: int = 0
    probed: int = 0
    rows: int = 0
    live: int = 0
    rejected: list[dict[str, str]] = dataclasses.field(default_factory=list)
    warnings: list[dict[str, str]] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    changed_catalog: bool = False


def rejected_rows(table: pa.Table) -> list[dict[str, str]]:
    """``{item, locator, error}`` of every rejected row, in catalog order (the scan report)."""
    rejected = table.filter(pc.is_valid(table["error"]))
    return rejected.select(["item", "locator", "error"]).to_pylist()


def limit_catalog(table: pa.Table, limits: ScanLimits
                  ) -> tuple[pa.Table | None, list[dict[str, str]]]:
    """A catalog taken as it is (a native shard dataset's own, never re-probed) under the
    scan's ``limits``: a live row above ``max_image_pixels`` becomes a rejected row, captions
    above ``max_caption_chars`` are capped. Returns ``(None, [])`` when no row is over a
    limit (the catalog is copied byte for byte), else the new table and the warnings."""
    pixels = pc.multiply(table["w"].cast(pa.int64()), table["h"].cast(pa.int64()))
    over = pc.greater(pixels, limits.max_image_pixels)
    for col in CHAR_COLUMNS:
        over = pc.or_(over, pc.greater(table[col], limits.max_caption_chars))
    over = pc.and_(over, table["live"]).to_pylist()
    if not any(over):
        return None, []
    records, warnings = table.to_pylist(), []
    for i in (i for i, flag in enumerate(over) if flag):
        rec = records[i]
        row = row_from_record(rec)
        if row.w * row.h > limits.max_image_pixels:
            row.error = (f"the catalogued size {row.w}x{row.h} = {row.w * row.h:,} pixels is "
                         f"above data.max_image_pixels = {limits.max_image_pixels:,}")
        else:
            cap_captions(row, limits.max_caption_chars)
            warnings += [{"item": rec["item"], "locator": row.locator, "warning": w}
                         for w in row.warnings]
        records[i] = _row_record(row, rec["id"], rec["item"], rec["stamp"], True)
    info = catalog_info(table)
    return _table(records, info.get("generation", 1), info.get("kind", "")), warnings


def _probe(item_probe: Callable[[], list[Row]]) -> list[Row]:
    return item_probe()


def probe_items(items: list[WalkItem], workers: int, progress: Callable[[int], None] | None = None
                ) -> list[list[Row]]:
    """Probe ``items`` (header reads), on a spawn process pool when it is worth it."""
    if workers > 1 and len(items) >= 64:
        chunk = max(1, len(items) // (workers * 8))
        ctx = multiprocessing.get_context("spawn")
        out: list[list[Row]] = []
        with ctx.Pool(workers) as pool:
            for rows in pool.imap(_probe, [it.probe for it in items], chunksize=chunk):
                out.append(rows)
                if progress:
                    progress(1)
        return out
    out = []
    for it in items:
        out.append(it.probe())
        if progress:
            progress(1)
    return out


def update_catalog(path: Path, kind: str, walk: list[WalkItem], *, rescan: bool = False,
                   workers: int = 0, progress: Callable[[int], None] | None = None
                   ) -> tuple[pa.Table, ScanStats]:
    """Bring the catalog at ``path`` up to date with ``walk``; write it only if it changed."""
    t0 = time.perf_counter()
    stats = ScanStats(items=len(walk))
    old: list[dict[str, Any]] = []
    generation = 0
    if path.is_file():
        try:
            table = read_catalog(path)
            old = table.to_pylist()
            generation = catalog_info(table).get("generation", 0)
        except CatalogError:
            old = []  # another layout: rebuilt by a full scan
    by_item: dict[str, list[int]] = {}
    for i, rec in enumerate(old):
        by_item.setdefault(rec["item"], []).append(i)

    seen: set[str] = set()
    to_probe: list[WalkItem] = []
    for it in walk:
        seen.add(it.key)
        idx = by_item.get(it.key)
        if idx is None:
            stats.new += 1
            to_probe.append(it)
            continue
        live_idx = [i for i in idx if old[i]["live"] or old[i]["error"] is not None]
        first = old[live_idx[0]] if live_idx else old[idx[0]]
        if rescan or not live_idx or tuple(first["stamp"]) != tuple(it.stamp):
            stats.changed += 1
            to_probe.append(it)
        else:
            stats.cached += 1

    probed = probe_items(to_probe, workers, progress)
    stats.probed = len(to_probe)
    stats.warnings = [{"item": it.key, "locator": row.locator, "warning": w}
                      for it, rows in zip(to_probe, probed) for row in rows for w in row.warnings]
    records = [dict(r) for r in old]
    next_id = len(records)
    changed = False
    for it, rows in zip(to_probe, probed):
        idx = [i for i in by_item.get(it.key, []) if records[i]["live"] or records[i]["error"]]
        if idx and len(idx) == len(rows):
            for i, row in zip(idx, rows):
                new = _row_record(row, records[i]["id"], it.key, it.stamp, True)
                changed |= new != records[i]
                records[i] = new
        else:
            for i in idx:
                records[i].update(live=False, weight=0.0, error=None)
            for row in rows:
                records.append(_row_record(row, next_id, it.key, it.stamp, True))
                next_id += 1
            changed = True
    for key, idx in by_item.items():
        if key in seen:
            continue
        for i in idx:
            if records[i]["live"] or records[i]["error"]:
                records[i].update(live=False, weight=0.0, error=None)
                stats.removed += 1
                changed = True

    if changed or not path.is_file():
        generation += 1
        table = _table(records, generation, kind)
        write_catalog(path, table)
        stats.changed_catalog = True
    else:
        table = _table(records, generation, kind)
    stats.rows = len(records)
    stats.live = sum(1 for r in records if r["live"])
    stats.rejected = rejected_rows(table)
    stats.seconds = time.perf_counter() - t0
    return table, stats
