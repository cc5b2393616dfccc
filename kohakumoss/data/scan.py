"""The scan: bring every dataset entry's catalog up to date (``docs/data.md#the-catalog``).

Output directory layout (a DVC output, persisted so re-scans are incremental)::

    <out>/<source>-<digest>.parquet   one catalog per dataset entry (native shard datasets
                                      are copied from their own catalog.parquet)
    <out>/index.json                  dataset index -> catalog file, in params order
    <out>/manifest.json               kind "catalog"

The scan report (rejected images with their reasons, the warnings of this run's probes,
and what this run probed) is written beside it, outside the catalog directory, so a
re-scan that changed nothing leaves the catalog directory byte-identical and DVC re-runs
nothing downstream.

Every probe runs under the ``data`` limits (``ScanLimits``: caption cap, caption decoding
policy, largest declared image, data verification); the manifest records them, and a
scan whose limits differ from the last one re-probes every file.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Any

from kohakumoss.artifacts import (ArtifactError, Manifest, atomic_path, atomic_write_json,
                                  code_version, make_manifest, read_manifest, write_manifest)
from kohakumoss.config import DataConfig, Params, stage_params
from kohakumoss.configlib import to_plain
from kohakumoss.data.catalog import (ScanStats, catalog_name, limit_catalog, read_catalog,
                                     rejected_rows, update_catalog, write_catalog)
from kohakumoss.data.rows import ScanLimits
from kohakumoss.errors import KohakuError
from kohakumoss.progress import progress

log = logging.getLogger(__name__)

KIND = "catalog"
SCHEMA = 1
PARAMS = ["data.datasets", "data.max_caption_chars", "data.caption_errors",
          "data.max_image_pixels", "data.verify_images"]
SHOWN = 20  # warnings logged per dataset; the report has them all
CODE = ("kohakumoss.data.sources", "kohakumoss.data.catalog", "kohakumoss.data.scan",
        "kohakumoss.data.rows")


class ScanError(KohakuError, RuntimeError):
    """A dataset yields no usable image at all."""


def scan_limits(data: DataConfig) -> ScanLimits:
    return ScanLimits(max_caption_chars=data.max_caption_chars, caption_errors=data.caption_errors,
                      max_image_pixels=data.max_image_pixels, verify_images=data.verify_images)


def _last_limits(out: Path) -> dict[str, Any] | None:
    """The limits the last scan into ``out`` recorded (None: no scan, or one before them)."""
    try:
        return read_manifest(out, KIND).info.get("limits")
    except ArtifactError:
        return None


def _table_stats(table: Any) -> ScanStats:
    return ScanStats(rows=table.num_rows, live=sum(table.column("live").to_pylist()),
                     rejected=rejected_rows(table))


def _scan_entry(i: int, entry: Any, out: Path, rescan: bool | str, workers: int,
                limits: ScanLimits) -> tuple[str, ScanStats]:
    source = entry.args
    args = to_plain(source)
    name = catalog_name(entry.source, args)
    path = out / name
    own = source.own_catalog()
    if own is not None:
        table = read_catalog(own)
        limited, warnings = limit_catalog(table, limits)
        if limited is None:
            with atomic_path(path) as tmp:
                shutil.copyfile(own, tmp)
        else:
            write_catalog(path, limited)
            table = limited
        return name, dataclasses.replace(_table_stats(table), warnings=warnings)
    if rescan == "never" and path.is_file():
        return name, _table_stats(read_catalog(path))
    walk = source.walk(limits)
    with progress(len(walk), f"scan [{i}] {entry.source}", "item", leave=False) as bar:
        _, stats = update_catalog(path, entry.source, walk, rescan=rescan is True,
                                  workers=workers, progress=bar.update)
    return name, stats


def _log_warnings(i: int, entry: Any, stats: ScanStats) -> None:
    where = to_plain(entry.args).get("path", "")
    for w in stats.warnings[:SHOWN]:
        log.warning("dataset %d (%s at %r): %s: %s", i, entry.source, where, w["locator"],
                    w["warning"])
    if len(stats.warnings) > SHOWN:
        log.warning("dataset %d: %d more warnings in the scan report", i,
                    len(stats.warnings) - SHOWN)


def scan(params: Params, out: str | Path, report: str | Path | None = None) -> tuple[Manifest, list[ScanStats]]:
    """Scan every dataset of ``params.data.datasets`` into catalogs under ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    limits = scan_limits(params.data)
    rescan = params.data.rescan
    last = _last_limits(out)
    if rescan is False and last is not None and last != dataclasses.asdict(limits):
        log.info("the data limits changed since the last scan (%s -> %s): re-probing every file",
                 last, dataclasses.asdict(limits))
        rescan = True
    index, all_stats = [], []
    for i, entry in enumerate(params.data.datasets):
        name, stats = _scan_entry(i, entry, out, rescan, params.data.scan_workers, limits)
        _log_warnings(i, entry, stats)
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
                           for e, s in zip(index, all_stats)],
              "limits": dataclasses.asdict(limits)})
    write_manifest(out, manifest)
    if report is not None:
        atomic_write_json(report, {"datasets": [
            {**e, **{k: v for k, v in dataclasses.asdict(s).items() if k != "changed_catalog"}}
            for e, s in zip(index, all_stats)]})
    return manifest, all_stats
