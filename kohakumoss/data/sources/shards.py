"""The ``moss_shard`` source: the native shard format and the import into it
(``docs/data.md#native-shards``).

Layout (the catalog is this project's Parquet catalog, not the reference's SQLite file)::

    <path>/catalog.parquet      rows, locators "<shard>:<index>"
    <path>/shards/00000.bin     concatenated encoded image files, no header, no padding
    <path>/shards/00000.idx     32-byte little-endian records, one per image, append order

Index record: u64 offset, u32 size, u16 width, u16 height (clamped to 65535), u8 codec id,
u8 flags (bit 0 = has alpha), 6 zero bytes, u64 content-hash prefix (first 16 hex digits
of the blake2b-128 hex). A writer rolls to the next shard when the current one is
non-empty and the image would push it past ``SHARD_BYTES`` (1 GiB). The dataset is read
through its own catalog, never walked; ``import_to_shards`` builds one from any source
(under the scan's ``ScanLimits``; the scan applies its own limits to the copy it takes).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import struct
from pathlib import Path
from typing import Any, NamedTuple

from kohakumoss.data.rows import Row, ScanLimits, WalkItem
from kohakumoss.data.sources.base import SourceError, check_args, content_hash, register_source

log = logging.getLogger(__name__)

SHARD_BYTES = 1 << 30  # roll-over limit; module-level so tests can shrink it
RECORD = struct.Struct("<QIHHBB6xQ")
assert RECORD.size == 32
CATALOG_NAME = "catalog.parquet"
CODECS = {".jpg": 1, ".jpeg": 1, ".png": 2, ".webp": 3, ".jxl": 4, ".avif": 5, ".bmp": 6}
ALPHA_FLAG = 1
REIMPORT_HINT = ("re-import the original dataset into it (dataset entry key import_to, "
                 "or kohakumoss.data.sources.import_to_shards(source, dest))")


class IndexRecord(NamedTuple):
    offset: int
    size: int
    width: int
    height: int
    codec: int
    flags: int
    hash_prefix: int


def pack_record(offset: int, size: int, w: int, h: int, codec: int, has_alpha: bool,
                hash_hex: str) -> bytes:
    return RECORD.pack(offset, size, min(w, 0xFFFF), min(h, 0xFFFF), codec,
                       ALPHA_FLAG if has_alpha else 0, int(hash_hex[:16], 16))


def unpack_record(data: bytes) -> IndexRecord:
    return IndexRecord(*RECORD.unpack(data))


def sniff_codec(data: bytes) -> int:
    """Codec id from the file signature (used when the locator has no image extension)."""
    if data[:3] == b"\xff\xd8\xff":
        return CODECS[".jpeg"]
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return CODECS[".png"]
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return CODECS[".webp"]
    if data[:2] == b"\xff\x0a" or data[4:12] == b"JXL \r\n\x87\n":
        return CODECS[".jxl"]
    if data[4:8] == b"ftyp" and data[8:12] in (b"avif", b"avis"):
        return CODECS[".avif"]
    if data[:2] == b"BM":
        return CODECS[".bmp"]
    return 0


def codec_of(locator: str, data: bytes) -> int:
    """Codec id from the original file extension (jpg = jpeg), else from the signature."""
    ext = os.path.splitext(locator)[1].lower()
    return CODECS[ext] if ext in CODECS else sniff_codec(data)


def shard_file(shards: Path, shard: int, suffix: str) -> Path:
    return shards / f"{shard:05d}{suffix}"


class ShardWriter:
    """Appends encoded images to ``<shards>/NNNNN.bin`` + ``.idx``; use as a context
    manager. ``append`` returns the image's locator ``"<shard>:<index>"``."""

    def __init__(self, shards: Path) -> None:
        self.shards = Path(shards)
        self.shard = -1
        self.size = 0
        self.count = 0
        self._bin: Any = None
        self._idx: Any = None

    def __enter__(self) -> ShardWriter:
        self.shards.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _roll(self) -> None:
        self.close()
        self.shard += 1
        self.size = self.count = 0
        self._bin = open(shard_file(self.shards, self.shard, ".bin"), "xb")
        self._idx = open(shard_file(self.shards, self.shard, ".idx"), "xb")

    def append(self, data: bytes, w: int, h: int, codec: int, has_alpha: bool,
               hash_hex: str) -> str:
        if self._bin is None or (self.size > 0 and self.size + len(data) > SHARD_BYTES):
            self._roll()
        self._bin.write(data)
        self._idx.write(pack_record(self.size, len(data), w, h, codec, has_alpha, hash_hex))
        locator = f"{self.shard}:{self.count}"
        self.size += len(data)
        self.count += 1
        return locator

    def close(self) -> None:
        for f in (self._bin, self._idx):
            if f is not None:
                f.close()
        self._bin = self._idx = None


def parse_locator(locator: str) -> tuple[int, int]:
    shard, _, index = locator.partition(":")
    if not (shard.isdigit() and index.isdigit()):
        raise ValueError(f"moss_shard locator must be '<shard>:<index>', got {locator!r}")
    return int(shard), int(index)


def read_record(shards: Path, shard: int, index: int) -> IndexRecord:
    with open(shard_file(shards, shard, ".idx"), "rb") as f:
        f.seek(index * RECORD.size)
        data = f.read(RECORD.size)
    if len(data) != RECORD.size:
        raise IndexError(f"{shard_file(shards, shard, '.idx')} has no record {index}")
    return unpack_record(data)


@register_source("moss_shard")
@dataclasses.dataclass(frozen=True)
class MossShardSource:
    path: str

    def __post_init__(self) -> None:
        check_args(self)

    def _shards(self) -> Path:
        shards = Path(self.path) / "shards"
        if not shards.is_dir():
            raise SourceError(f"moss_shard source: {str(shards)!r} does not exist (resolved "
                              f"to {str(shards.absolute())!r}); {self.path!r} is not a shard "
                              f"dataset: {REIMPORT_HINT}")
        return shards

    def walk(self, limits: ScanLimits = ScanLimits()) -> list[WalkItem]:
        raise SourceError(f"moss_shard source {self.path!r} is not walked: shard datasets "
                          f"are read through their own catalog ({CATALOG_NAME}, see "
                          "own_catalog()), written when they are imported")

    def own_catalog(self) -> Path | None:
        self._shards()
        catalog = Path(self.path) / CATALOG_NAME
        if not catalog.is_file():
            other = " (a catalog.db of the reference layout is not read)" if (
                Path(self.path) / "catalog.db").exists() else ""
            raise SourceError(f"moss_shard source: {str(catalog)!r} is missing{other}; "
                              f"{REIMPORT_HINT}")
        return catalog

    def open(self, locator: str) -> bytes:
        shards = self._shards()
        shard, index = parse_locator(locator)
        rec = read_record(shards, shard, index)
        with open(shard_file(shards, shard, ".bin"), "rb") as f:
            f.seek(rec.offset)
            data = f.read(rec.size)
        if len(data) != rec.size:
            raise ValueError(f"{shard_file(shards, shard, '.bin')}: short read for {locator}")
        return data


def write_shards(source: Any, shards: Path, limits: ScanLimits = ScanLimits()) -> list[Row]:
    """Walk and probe ``source`` under ``limits``, copy every good row's bytes into shards
    under ``shards`` and return the rows with ``extra.hash``, ``extra.origin`` and shard
    locators. Rows with a probe error are reported in the log and left out."""
    out: list[Row] = []
    with ShardWriter(shards) as writer:
        for item in source.walk(limits):
            for row in item.probe():
                for warning in row.warnings:
                    log.warning("import: %s: %s", row.locator, warning)
                if row.error is not None:
                    log.warning("import: skipping %s (%s)", row.locator, row.error)
                    continue
                data = source.open(row.locator)
                digest = content_hash(data)
                locator = writer.append(data, row.w, row.h, codec_of(row.locator, data),
                                        row.has_alpha, digest)
                row.extra = {**row.extra, "hash": digest, "origin": row.locator}
                row.locator = locator
                out.append(row)
    return out


def import_to_shards(source: Any, dest: str | Path, limits: ScanLimits = ScanLimits()) -> Path:
    """Copy ``source`` (any source object) into a native shard dataset at ``dest`` and
    write its catalog; returns the catalog path. Shards are written to a temporary folder
    renamed into place, so a failed import leaves no half dataset behind."""
    from kohakumoss.data.catalog import write_rows_catalog

    dest = Path(dest)
    shards = dest / "shards"
    if shards.exists() and any(shards.iterdir()):
        raise SourceError(f"import_to {str(dest)!r} already holds shards/; delete {str(shards)!r} "
                          "(and its catalog) to re-import, or choose another import_to folder")
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / f"shards.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        rows = write_shards(source, tmp, limits)
        if not rows:
            raise SourceError(f"import_to {str(dest)!r}: the source yielded no readable image")
        if shards.exists():
            shards.rmdir()
        os.replace(tmp, shards)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    catalog = dest / CATALOG_NAME
    write_rows_catalog(catalog, rows)
    log.info("imported %d images into %s", len(rows), dest)
    return catalog
