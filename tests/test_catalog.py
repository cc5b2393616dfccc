"""The incremental catalog and the scan: only changed items are probed, ids stay stable."""

from __future__ import annotations

import json
import os

import pytest

from kohakumoss.data.catalog import read_catalog, update_catalog
from kohakumoss.data.scan import ScanError, scan
from kohakumoss.data.sources import SOURCES, SourceError

from conftest import make_kohya, make_params, write_image


def _walk(path):
    return SOURCES["kohya"](path=str(path)).walk()


def _bump_mtime(path, seconds=5):
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + seconds * 10**9))


def test_rescan_probes_only_the_changed_file(tmp_path, kohya_dataset):
    cat = tmp_path / "c.parquet"
    table, s1 = update_catalog(cat, "kohya", _walk(kohya_dataset))
    assert (s1.new, s1.probed, s1.live) == (7, 7, 7)
    ids = dict(zip(table.column("locator").to_pylist(), table.column("id").to_pylist()))
    bytes_before = cat.read_bytes()

    _, s2 = update_catalog(cat, "kohya", _walk(kohya_dataset))
    assert (s2.probed, s2.cached, s2.changed_catalog) == (0, 7, False)
    assert cat.read_bytes() == bytes_before  # nothing changed: not even rewritten

    target = kohya_dataset / "3_alpha" / "img_001.png"
    write_image(target, 200, 100, seed=99)
    _bump_mtime(target)
    (kohya_dataset / "1_beta" / "img_000.txt").write_text("new, tags")
    _bump_mtime(kohya_dataset / "1_beta" / "img_000.txt")
    table3, s3 = update_catalog(cat, "kohya", _walk(kohya_dataset))
    assert (s3.probed, s3.changed, s3.cached) == (2, 2, 5)
    rows = {r["locator"]: r for r in table3.to_pylist()}
    assert (rows["3_alpha/img_001.png"]["w"], rows["3_alpha/img_001.png"]["h"]) == (200, 100)
    assert rows["1_beta/img_000.png"]["tags"] == ["new", "tags"]
    assert {loc: r["id"] for loc, r in rows.items()} == ids  # ids stable


def test_removed_and_added_files(tmp_path, kohya_dataset):
    cat = tmp_path / "c.parquet"
    update_catalog(cat, "kohya", _walk(kohya_dataset))
    (kohya_dataset / "1_beta" / "img_001.png").unlink()
    write_image(kohya_dataset / "1_beta" / "img_zzz.png", 33, 44)
    table, s = update_catalog(cat, "kohya", _walk(kohya_dataset))
    assert (s.removed, s.new, s.probed) == (1, 1, 1)
    rows = {r["locator"]: r for r in table.to_pylist()}
    assert rows["1_beta/img_001.png"]["live"] is False
    assert rows["1_beta/img_zzz.png"]["id"] == 7  # ids never reused
    # the file comes back: a new id, the old one stays a tombstone
    write_image(kohya_dataset / "1_beta" / "img_001.png", 10, 10)
    table, _ = update_catalog(cat, "kohya", _walk(kohya_dataset))
    back = [r for r in table.to_pylist() if r["locator"] == "1_beta/img_001.png"]
    assert [(r["id"], r["live"]) for r in back] == [(1, False), (8, True)]


def test_corrupt_image_is_reported_and_not_reprobed(tmp_path, kohya_dataset):
    bad = kohya_dataset / "3_alpha" / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
    cat = tmp_path / "c.parquet"
    table, s = update_catalog(cat, "kohya", _walk(kohya_dataset))
    assert s.live == 7 and len(s.rejected) == 1 and s.rejected[0]["locator"] == "3_alpha/broken.png"
    _, s2 = update_catalog(cat, "kohya", _walk(kohya_dataset))
    assert s2.probed == 0 and len(s2.rejected) == 1
    # fixed file: probed again and becomes live under the same id
    write_image(bad, 32, 32)
    _bump_mtime(bad)
    table, s3 = update_catalog(cat, "kohya", _walk(kohya_dataset))
    assert s3.probed == 1 and s3.live == 8 and not s3.rejected


def test_broken_links_are_reported_until_fixed(tmp_path, kohya_dataset):
    folder = kohya_dataset / "3_alpha"
    link, sidecar = folder / "link.png", folder / "img_000.txt"
    link.symlink_to("target.png")  # dangling
    sidecar.unlink()
    sidecar.symlink_to("img_000.txt")  # a sidecar that loops
    cat = tmp_path / "c.parquet"
    table, s = update_catalog(cat, "kohya", _walk(kohya_dataset))
    errors = {r["locator"]: r["error"] for r in s.rejected}
    assert set(errors) == {"3_alpha/link.png", "3_alpha/img_000.png"} and s.live == 6
    assert "link.png is a symbolic link to a missing file" in errors["3_alpha/link.png"]
    assert "img_000.txt is a symbolic link loop" in errors["3_alpha/img_000.png"]
    ids = dict(zip(table.column("locator").to_pylist(), table.column("id").to_pylist()))
    write_image(link.parent / "target.png", 24, 24)  # both fixed: live under the same ids
    sidecar.unlink()
    sidecar.write_text("fixed, tags")
    table, s2 = update_catalog(cat, "kohya", _walk(kohya_dataset))
    assert (s2.changed, s2.new, s2.live) == (2, 1, 9) and not s2.rejected  # new: target.png
    live = {r["locator"]: r["id"] for r in table.to_pylist() if r["live"]}
    assert live["3_alpha/link.png"] == ids["3_alpha/link.png"]
    assert live["3_alpha/img_000.png"] == ids["3_alpha/img_000.png"]


def test_parallel_probe_matches_serial(tmp_path):
    ds = make_kohya(tmp_path / "big", {"1_a": [(20 + i, 30) for i in range(70)]}, tags=False)
    serial, _ = update_catalog(tmp_path / "s.parquet", "kohya", _walk(ds), workers=0)
    parallel, _ = update_catalog(tmp_path / "p.parquet", "kohya", _walk(ds), workers=2)
    assert serial.equals(parallel)


def test_scan_stage_outputs_and_report(tmp_path, kohya_dataset):
    (kohya_dataset / "3_alpha" / "bad.jpg").write_bytes(b"not an image")
    p = make_params([{"source": "kohya", "path": str(kohya_dataset)}])
    out, report = tmp_path / "catalog", tmp_path / "report.json"
    m1, _ = scan(p, out, report)
    rep = json.loads(report.read_text())
    assert rep["datasets"][0]["live"] == 7
    assert rep["datasets"][0]["rejected"][0]["locator"] == "3_alpha/bad.jpg"
    snapshot = {f.name: f.read_bytes() for f in out.iterdir()}
    m2, stats = scan(p, out, report)
    assert m2 == m1 and stats[0].probed == 0
    assert {f.name: f.read_bytes() for f in out.iterdir()} == snapshot  # byte-identical rescan


def test_scan_errors(tmp_path):
    with pytest.raises(SourceError, match="missing"):
        scan(make_params([{"source": "kohya", "path": str(tmp_path / "missing")}]), tmp_path / "o")
    empty = tmp_path / "empty" / "1_x"
    empty.mkdir(parents=True)
    with pytest.raises(SourceError):
        scan(make_params([{"source": "kohya", "path": str(tmp_path / "empty")}]), tmp_path / "o")
    only_bad = tmp_path / "bad" / "1_x"
    only_bad.mkdir(parents=True)
    (only_bad / "a.png").write_bytes(b"nope")
    with pytest.raises(ScanError, match="no usable image"):
        scan(make_params([{"source": "kohya", "path": str(tmp_path / "bad")}]), tmp_path / "o")


def test_read_catalog_rejects_foreign_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kohakumoss.data.catalog import CatalogError

    pq.write_table(pa.table({"x": [1]}), tmp_path / "c.parquet")
    with pytest.raises(CatalogError, match="another layout"):
        read_catalog(tmp_path / "c.parquet")
    # update_catalog rebuilds it with a full scan instead of failing


def test_failed_scan_loses_nothing(tmp_path, kohya_dataset):
    import shutil

    p = make_params([{"source": "kohya", "path": str(kohya_dataset)}])
    out = tmp_path / "catalog"
    scan(p, out)
    snapshot = {f.name: f.read_bytes() for f in out.iterdir()}
    moved = tmp_path / "moved"
    shutil.move(kohya_dataset, moved)  # the dataset disappears (unmounted disk, typo'd path)
    with pytest.raises(SourceError):
        scan(p, out)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == snapshot
