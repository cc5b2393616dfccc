"""All datasets' catalogs as one in-memory table for planning (``docs/data.md#row-identity``).

Planning columns are numpy arrays over the concatenation of the catalogs in params order;
``uid`` = ``dataset << 40 | local id`` names a row stably (adding images to one dataset
does not rename the rows of another), and every seeded draw of the planner is keyed by it.
Caption fields are materialised per row on demand. ``load_catalogs`` checks every file
against the hash the scan's manifest records (``check_files``) before reading it.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa

from kohakumoss.artifacts import MANIFEST, ArtifactError, Manifest, read_manifest, verify_files
from kohakumoss.config import DatasetEntry
from kohakumoss.configlib import to_plain
from kohakumoss.data.catalog import CHAR_COLUMNS, catalog_name, read_catalog, row_from_record
from kohakumoss.data.rows import Row
from kohakumoss.errors import IntegrityError

UID_SHIFT = 40


def make_uid(dataset: np.ndarray, local: np.ndarray) -> np.ndarray:
    return (dataset.astype(np.int64) << UID_SHIFT) | local.astype(np.int64)


class CatalogSet:
    def __init__(self, datasets: tuple[DatasetEntry, ...], tables: list[pa.Table],
                 manifest: Manifest | None = None):
        self.datasets = datasets
        self.tables = tables
        self.manifest = manifest
        ds, cols = [], {k: [] for k in ("id", "w", "h", "weight", "live", "has_alpha", *CHAR_COLUMNS)}
        for d, (entry, t) in enumerate(zip(datasets, tables)):
            ds.append(np.full(t.num_rows, d, np.int32))
            for k in cols:
                cols[k].append(t.column(k).to_numpy(zero_copy_only=False))
            cols["weight"][-1] = (cols["weight"][-1].astype(np.float32)
                                  * np.float32(entry.weight)).astype(np.float32)
        cat = {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in cols.items()}
        self.dataset = np.concatenate(ds) if ds else np.zeros(0, np.int32)
        self.local = cat["id"].astype(np.int64)
        self.uid = make_uid(self.dataset, self.local)
        self.w = cat["w"].astype(np.int64)
        self.h = cat["h"].astype(np.int64)
        self.live = cat["live"].astype(bool)
        self.weight = np.where(self.live, cat["weight"], np.float32(0)).astype(np.float32)
        self.has_alpha = cat["has_alpha"].astype(bool)
        self.chars = {k: cat[k].astype(np.int64) for k in CHAR_COLUMNS}
        self.offsets = np.cumsum([0] + [t.num_rows for t in tables])

    def __len__(self) -> int:
        return len(self.uid)

    @cached_property
    def _records(self) -> list[list[dict]]:
        keep = ["locator", "w", "h", "has_alpha", "group", "weight", "tags", "caption_nl",
                "artist", "rating", "json", "extra", "error"]
        return [t.select(keep).to_pylist() for t in self.tables]

    def row(self, p: int) -> Row:
        """The full row at concatenated position ``p``."""
        d = int(self.dataset[p])
        return row_from_record(self._records[d][p - int(self.offsets[d])])


def check_files(directory: Path, manifest: Manifest, made_by: str) -> None:
    """Every file ``manifest`` lists must have the bytes it records, else a one-line
    ``IntegrityError`` naming the first that does not and the stage that rebuilds it."""
    bad = verify_files(directory, manifest)
    if bad:
        path = directory / bad[0]
        state = ("is missing" if not path.is_file() else
                 f"does not match the hash {directory / MANIFEST} records (changed, truncated or corrupt)")
        raise IntegrityError(f"{path} {state}; rebuild it with `kmoss {made_by}` (or `dvc repro`)")


def load_catalogs(directory: str | Path, datasets: tuple[DatasetEntry, ...]) -> CatalogSet:
    """Open the scan's output for ``datasets``; a stale, foreign or damaged directory is refused."""
    directory = Path(directory)
    manifest = read_manifest(directory, "catalog", made_by="scan")
    check_files(directory, manifest, "scan")
    index = json.loads((directory / "index.json").read_text(encoding="utf-8"))
    expected = [catalog_name(d.source, to_plain(d.args)) for d in datasets]
    if [e["catalog"] for e in index] != expected:
        raise ArtifactError(f"the catalogs in {directory} were scanned for other datasets "
                            f"({[e['source'] for e in index]}); run `kmoss scan` again")
    tables = [read_catalog(directory / e["catalog"]) for e in index]
    return CatalogSet(datasets, tables, manifest)
