"""The scan: bring every dataset entry's catalog up to date (``spec/data.md`` section 5).

Output directory layout (a DVC output, persisted so re-scans are incremental)::

    <out>/<source>-<digest>.parquet   one catalog per dataset entry (native shard datasets
                                      are copied from their own catalog.parquet)
    <out>/index.json                  dataset index -> catalog file, in params order
    <out>/manifest.json               kind "catalog"

The scan report (rejected images with their reasons, and what this run probed) is written
beside it, outside the catalog directory, so a re-scan that changed nothing leaves the
catalog directory byte-identical and DVC re-runs nothing downstream.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from kohakumoss.artifacts import (Manifest, atomic_path, atomic_write_json, code_version,
                                  make_manifest, write_manifest)
from kohakumoss.config import Params, stage_params
from kohakumoss.configlib import to_plain
from kohakumoss.data.catalog import ScanStats, catalog_name, read_catalog, update_catalog
from kohakumoss.errors import KohakuError

KIND = "catalog"
SCHEMA = 1
PARAMS = ["data.datasets"]
CODE = ("kohakumoss.data.sources", "kohakumoss.data.catalog", "kohakumoss.data.scan",
        "kohakumoss.data.rows")


class ScanError(KohakuError, RuntimeError):
    """A dataset yields no usable image at all."""


def _scan_entry(i: int, entry: Any, out: Path, rescan: bool | str, workers: int
                ) -> tuple[str, ScanStats]:
    source = entry.args
    args = to_plain(source)
    name = catalog_name(entry.source, args)
    path = out / name
    own = source.own_catalog()
    if own is not None:
        table = read_catalog(own)
        with atomic_path(path) as tmp:
            shutil.copyfile(own, tmp)
        stats = ScanStats(rows=table.num_rows, live=sum(table.column("live").to_pylist()))
        return name, stats
    if rescan == "never" and path.is_file():
        table = read_catalog(path)
        return name, ScanStats(rows=table.num_rows, live=sum(table.column("live").to_pylist()))
    walk = source.walk()
    with tqdm(total=len(walk), desc=f"scan [{i}] {entry.source}", unit="item", leave=False,
              disable=None) as bar:
        _, stats = update_catalog(path, entry.source, walk, rescan=rescan is True,
                                  workers=workers, progress=bar.update)
    return name, stats


def scan(params: Params, out: str | Path, report: str | Path | None = None) -> tuple[Manifest, list[ScanStats]]:
    """Scan every dataset of ``params.data.datasets`` into catalogs under ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    index, all_stats = [], []
    for i, entry in enumerate(params.data.datasets):
        name, stats = _scan_entry(i, entry, out, params.data.rescan, params.data.scan_workers)
        if stats.live == 0:
            where = to_plain(entry.args).get("path", "")
            reasons = "; ".join(f"{r['locator']}: {r['error']}" for r in stats.rejected[:3])
            raise ScanError(f"dataset {i} ({entry.source} at {where!r}) has no usable image"
                            + (f" (rejected: {reasons})" if reasons else "")
                            + "; check the path and the image files")
        index.append({"dataset": i, "source": entry.source, "catalog": name})
        all_stats.append(stats)
    atomic_write_json(out / "index.json", index)
    manifest = make_manifest(
        KIND, SCHEMA, params=stage_params(params, PARAMS), inputs={}, code=code_version(*CODE),
        directory=out, files=["index.json", *(e["catalog"] for e in index)],
        info={"datasets": [{**e, "rows": s.rows, "live": s.live, "rejected": len(s.rejected)}
                           for e, s in zip(index, all_stats)]})
    write_manifest(out, manifest)
    if report is not None:
        atomic_write_json(report, {"datasets": [
            {**e, **{k: v for k, v in dataclasses.asdict(s).items() if k != "changed_catalog"}}
            for e, s in zip(index, all_stats)]})
    return manifest, all_stats
