"""The ``parquet`` source: a table of image paths or image bytes (``docs/data.md#parquet``).

- Path mode (``bytes_col`` unset): column ``image_col`` holds paths relative to ``root``
  (default: the table's folder); one walk item per table row, keyed ``<relpath>#<n>``,
  stamped ``(size, mtime_ns, hash of the other fields + weight + group, 0, -1 x 4)``.
- Bytes mode (``bytes_col`` set): the whole file is one walk item ``file:<abs path>``
  stamped with its ``(size, mtime_ns)``; rows are read in record batches of 1024, row i
  gets locator ``row:<i>`` and ``extra.hash`` = content hash; ``image_col`` is dropped.

Columns ``weight`` / ``group`` are popped (null -> 1.0 / ""); other non-null fields go
through the JSON mapping (``docs/data.md#sidecars-and-json-metadata``). A text cell that
is not UTF-8 (Parquet does not check)
follows ``data.caption_errors`` like a sidecar. ``open`` in bytes mode reads one row group through a
per-process cache (never pickled; keyed by path, mtime and pid).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from kohakumoss.data.rows import Row, ScanLimits, WalkItem, cap_captions
from kohakumoss.data.sources.base import (
    CaptionEncodingError,
    SourceError,
    apply_json_meta,
    check_args,
    decode_caption,
    line_hash,
    pad_stamp,
    probe_bytes,
    register_source,
    relative_locator,
)
from kohakumoss.data.sources.jsonl import manifest_item, pop_weight_group

BATCH_ROWS = 1024


def image_bytes(value: Any) -> bytes | None:
    """A bytes cell, or the ``bytes`` field of a Hugging Face ``Image`` struct cell."""
    if isinstance(value, dict):
        value = value.get("bytes")
    return value if isinstance(value, (bytes, bytearray)) else None


def _non_null(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if v is not None}


def _json_safe(meta: dict[str, Any]) -> dict[str, Any]:
    """Metadata as plain JSON values (dates, decimals, bytes become strings) so catalogs
    can store it."""
    return json.loads(json.dumps(meta, default=str))


def batch_records(batch: pa.RecordBatch, path: str, start: int, policy: str
                  ) -> list[tuple[dict[str, Any], list[str], str | None]]:
    """The rows of a record batch as ``(record, warnings, error)``: a text cell that is not
    UTF-8 follows ``data.caption_errors`` (``decode_caption``); a skipped row keeps its
    U+FFFD text (so its image is still named) and carries the error. Nested text (a list
    of strings) cannot be replaced: its row is rejected unless the policy is strict."""
    try:
        return [(record, [], None) for record in batch.to_pylist()]
    except UnicodeDecodeError:
        pass
    out = []
    for i in range(batch.num_rows):
        record: dict[str, Any] = {}
        notes: list[str] = []
        error = None
        for name, column in zip(batch.schema.names, batch.columns):
            try:
                record[name] = column[i].as_py()
                continue
            except UnicodeDecodeError:
                where = f"{path} row {start + i} column {name!r}"
            if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
                record[name], error = None, f"{where}: invalid UTF-8 in a nested text column"
                if policy == "strict":
                    raise CaptionEncodingError(f"{error} (data.caption_errors: strict)")
                continue
            data = column.slice(i, 1).cast(pa.large_binary())[0].as_py()
            try:
                record[name] = decode_caption(data, where, policy, notes)
            except ValueError as e:  # skip
                record[name], error = data.decode("utf-8", errors="replace"), str(e)
        out.append((record, notes, error))
    return out


def probe_parquet_bytes(path: str, bytes_col: str, image_col: str,
                        limits: ScanLimits = ScanLimits()) -> list[Row]:
    """All rows of a bytes-mode table (header probes of the in-memory bytes)."""
    rows: list[Row] = []
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS)
        for batch in batches:
            for record, notes, error in batch_records(batch, path, len(rows),
                                                      limits.caption_errors):
                locator = f"row:{len(rows)}"
                data = image_bytes(record.pop(bytes_col))
                record.pop(image_col, None)
                try:
                    weight, group = pop_weight_group(record, f"{path} {locator}")
                except SourceError as e:
                    rows.append(Row(locator, error=str(e)))
                    continue
                if error is not None:
                    rows.append(Row(locator, group=group, weight=weight, error=error))
                    continue
                row = probe_bytes(data, locator, limits, group=group, weight=weight)
                if row.error is not None:
                    row.error = f"{path} {locator}: {row.error}"
                else:
                    try:
                        apply_json_meta(row, _json_safe(_non_null(record)))
                        cap_captions(row, limits.max_caption_chars)
                    except (TypeError, ValueError) as e:
                        row = Row(locator, group=group, weight=weight, error=str(e))
                row.warnings[:0] = notes
                rows.append(row)
    except (OSError, pa.ArrowException) as e:
        rows.append(Row(f"row:{len(rows)}", error=f"unreadable parquet file {path} ({e})"))
    return rows


@functools.lru_cache(maxsize=8)
def _row_group_starts(path: str, mtime_ns: int, pid: int) -> tuple[pq.ParquetFile, list[int]]:
    pf = pq.ParquetFile(path)
    starts, total = [], 0
    for rg in range(pf.num_row_groups):
        starts.append(total)
        total += pf.metadata.row_group(rg).num_rows
    return pf, starts


@functools.lru_cache(maxsize=4)
def _row_group_column(path: str, mtime_ns: int, pid: int, rg: int, column: str) -> pa.ChunkedArray:
    pf, _ = _row_group_starts(path, mtime_ns, pid)
    return pf.read_row_group(rg, columns=[column]).column(0)


def read_row_bytes(path: str, column: str, index: int) -> bytes:
    """Row ``index`` of ``column`` in a Parquet file, one row group read (cached)."""
    key = (path, os.stat(path).st_mtime_ns, os.getpid())
    pf, starts = _row_group_starts(*key)
    if not 0 <= index < pf.metadata.num_rows:
        raise IndexError(f"{path} has {pf.metadata.num_rows} rows, asked for row {index}")
    rg = bisect.bisect_right(starts, index) - 1
    data = image_bytes(_row_group_column(*key, rg, column)[index - starts[rg]].as_py())
    if data is None:
        raise ValueError(f"{path} row {index}: column {column!r} holds no image bytes")
    return bytes(data)


@register_source("parquet")
@dataclasses.dataclass(frozen=True)
class ParquetSource:
    path: str
    image_col: str = "image"
    bytes_col: str | None = None
    root: str | None = None
    hash_content: bool = False

    def __post_init__(self) -> None:
        check_args(self)

    def image_root(self) -> Path:
        return Path(self.root) if self.root is not None else Path(self.path).parent

    def _open_table(self) -> pq.ParquetFile:
        table = Path(self.path)
        if not table.is_file():
            raise SourceError(f"parquet source: file {str(table)!r} does not exist "
                              f"(resolved to {str(table.absolute())!r}); set path to a "
                              ".parquet file")
        try:
            pf = pq.ParquetFile(table)
        except (OSError, pa.ArrowException) as e:
            raise SourceError(f"parquet source: {str(table)!r} is not a readable Parquet "
                              f"file ({e})") from None
        column = self.bytes_col if self.bytes_col is not None else self.image_col
        role = "bytes_col" if self.bytes_col is not None else "image_col"
        names = pf.schema_arrow.names
        if column not in names:
            raise SourceError(f"parquet source {str(table)!r}: {role} {column!r} is not a "
                              f"column (columns: {', '.join(names)}); set {role} to the "
                              "column that holds the image " +
                              ("bytes" if role == "bytes_col" else "paths"))
        return pf

    def walk(self, limits: ScanLimits = ScanLimits()) -> list[WalkItem]:
        pf = self._open_table()
        if self.bytes_col is not None:
            abs_path = str(Path(self.path).absolute())
            st = os.stat(abs_path)
            probe = functools.partial(probe_parquet_bytes, abs_path, self.bytes_col,
                                      self.image_col, limits)
            return [WalkItem(f"file:{abs_path}", pad_stamp(st.st_size, st.st_mtime_ns), probe)]
        abs_root = self.image_root().absolute()
        items: list[WalkItem] = []
        seen: dict[str, int] = {}
        try:
            for batch in pf.iter_batches(batch_size=BATCH_ROWS):
                for record, notes, error in batch_records(batch, self.path, len(items),
                                                          limits.caption_errors):
                    where = f"{self.path} row {len(items)}"
                    value = record.pop(self.image_col)
                    if value is None:
                        raise SourceError(f"{where}: image_col {self.image_col!r} is null; "
                                          "every row needs an image path")
                    weight, group = pop_weight_group(record, where)
                    fields = _non_null(record)
                    fields_hash = line_hash(repr(sorted(fields.items())) + f"|{weight}|{group}")
                    items.append(manifest_item(abs_root, relative_locator(value), seen,
                                               fields_hash, weight, group, _json_safe(fields),
                                               self.hash_content, limits, notes, error))
        except (OSError, pa.ArrowException) as e:
            raise SourceError(f"parquet source: {str(self.path)!r} is not a readable Parquet "
                              f"file ({e})") from None
        return items

    def open(self, locator: str) -> bytes:
        if self.bytes_col is None:
            return (self.image_root() / locator).read_bytes()
        kind, _, index = locator.partition(":")
        if kind != "row" or not index.isdigit():
            raise ValueError(f"parquet bytes locator must be 'row:<i>', got {locator!r}")
        return read_row_bytes(str(Path(self.path).absolute()), self.bytes_col, int(index))

    def own_catalog(self) -> Path | None:
        return None
