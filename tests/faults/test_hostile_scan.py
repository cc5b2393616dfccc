"""Hostile and broken input: the scan reports and skips each bad file, naming it, and goes on.

A kohya dataset of good images plus one of each fault (decompression bombs declared in a
PNG and a JPEG header, a symbolic link loop, a dangling link, a first-level link to the
dataset itself, unreadable sidecars, a 10 MB caption, a caption that is not UTF-8, truncated
and empty images) is scanned through the library and through `kmoss scan`; the other
sources (jsonl, parquet, webdataset, moss_shard) get the same faults in their own form.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import os
import pickle
import struct
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image
from typer.testing import CliRunner

from kohakumoss.data.catalog import read_catalog
from kohakumoss.data.loader import PlanBatches, decode_image
from kohakumoss.data.planfile import make_plan
from kohakumoss.data.rows import MAX_CAPTION_CHARS, Row, ScanLimits, cap_captions
from kohakumoss.data.scan import scan
from kohakumoss.data.sources import import_to_shards
from kohakumoss.data.sources.base import CaptionEncodingError
from kohakumoss.data.sources.folder import FolderSource
from kohakumoss.errors import KohakuError
from stages.cli import app

from conftest import BASE, make_params, write_image

runner = CliRunner()
TEN_MB = 10 * 1024 * 1024
BAD_UTF8 = b"tag one, caf\xe9 au lait, \xff\xfe"


# ---- hostile files -----------------------------------------------------------------------

def png_bytes(w: int = 16, h: int = 16, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def jpeg_bytes(w: int = 64, h: int = 64) -> bytes:
    buf = io.BytesIO()
    rng = np.random.default_rng(1)
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def bomb_png(w: int = 50000, h: int = 50000) -> bytes:
    """A 60-byte PNG whose IHDR declares ``w x h`` RGB pixels (valid CRCs, a tiny IDAT)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data)
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


def bomb_jpeg(w: int = 50000, h: int = 50000) -> bytes:
    """A small JPEG whose SOF0 header is patched to declare ``w x h``."""
    data = bytearray(jpeg_bytes(16, 16))
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", h, w)
    return bytes(data)


def hostile_kohya(root: Path, good: int = 3) -> dict[str, str]:
    """Write the hostile kohya dataset; returns rejected locator -> the file its error names."""
    d = root / "5_set"
    for i in range(good):
        write_image(d / f"good_{i}.png", 32, 32, seed=i)
        (d / f"good_{i}.txt").write_text(f"good, tag {i}")
    (d / "bomb.png").write_bytes(bomb_png())
    (d / "bomb.jpg").write_bytes(bomb_jpeg())
    os.symlink("loop_b.png", d / "loop_a.png")  # a -> b -> a
    os.symlink("loop_a.png", d / "loop_b.png")
    os.symlink("no-such-file.png", d / "dangling.png")
    os.symlink(".", root / "loop")  # a first-level folder link to the dataset itself
    write_image(d / "sidecar_dir.png", 32, 32)
    (d / "sidecar_dir.txt").mkdir()  # a sidecar that cannot be read
    write_image(d / "sidecar_link.png", 32, 32)
    os.symlink("nowhere.caption", d / "sidecar_link.caption")
    write_image(d / "sidecar_loop.png", 32, 32)
    os.symlink("sidecar_loop.json", d / "sidecar_loop.json")
    write_image(d / "long.png", 32, 32)
    (d / "long.txt").write_text("tag, " * (TEN_MB // 5))  # 10 MB of tags
    (d / "long.caption").write_text("a" * TEN_MB)  # a 10 MB caption
    (d / "long.json").write_text(json.dumps({"source": "web", "description": "d" * TEN_MB}))
    write_image(d / "badutf8.png", 32, 32)
    (d / "badutf8.txt").write_bytes(BAD_UTF8)
    (d / "truncated.png").write_bytes(png_bytes(64, 64)[:300])
    jpeg = jpeg_bytes()
    (d / "truncated.jpg").write_bytes(jpeg[:len(jpeg) // 2])
    (d / "zero.png").write_bytes(b"")
    return {"5_set/bomb.png": "bomb.png", "5_set/bomb.jpg": "bomb.jpg",
            "5_set/loop_a.png": "loop_a.png", "5_set/loop_b.png": "loop_b.png",
            "5_set/dangling.png": "dangling.png", "loop": "loop",
            "5_set/sidecar_dir.png": "sidecar_dir.txt",
            "5_set/sidecar_link.png": "sidecar_link.caption",
            "5_set/sidecar_loop.png": "sidecar_loop.json",
            "5_set/badutf8.png": "badutf8.txt", "5_set/truncated.png": "truncated.png",
            "5_set/truncated.jpg": "truncated.jpg", "5_set/zero.png": "zero.png"}


REASONS = {"bomb": "decompression bomb", "loop": "loop", "dangling": "missing file",
           "sidecar_dir": "not a regular file", "sidecar_link": "missing file",
           "sidecar_loop": "loop", "badutf8": "invalid UTF-8", "truncated": "truncated",
           "zero": "not a recognised image"}


def reason_of(locator: str) -> str:
    stem = locator.rsplit("/", 1)[-1].split(".")[0]
    return REASONS.get(stem.removesuffix("_a").removesuffix("_b"), stem)


def params_file(tmp_path: Path, datasets: list[dict], **data) -> Path:
    raw = copy.deepcopy(BASE)
    raw["data"].update(datasets=datasets, **data)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def report_of(path: Path) -> dict:
    return json.loads(path.read_text())["datasets"][0]


# ---- the kohya dataset, through the library and the CLI ----------------------------------

def test_scan_reports_every_hostile_file_and_keeps_the_good_ones(tmp_path, caplog):
    expected = hostile_kohya(tmp_path / "ds")
    p = make_params([{"source": "kohya", "path": str(tmp_path / "ds")}])
    with caplog.at_level(logging.WARNING):
        _, (stats,) = scan(p, tmp_path / "catalog", tmp_path / "report.json")
    rejected = {r["locator"]: r["error"] for r in report_of(tmp_path / "report.json")["rejected"]}
    assert set(rejected) == set(expected)
    for locator, error in rejected.items():
        assert expected[locator] in error and reason_of(locator) in error, (locator, error)
    table = read_catalog(tmp_path / "catalog" / json.loads(
        (tmp_path / "catalog" / "index.json").read_text())[0]["catalog"]).to_pylist()
    live = {r["locator"]: r for r in table if r["live"]}
    assert set(live) == {f"5_set/{name}.png" for name in ("good_0", "good_1", "good_2", "long")}
    long = live["5_set/long.png"]  # capped, each field, with a warning naming the image
    assert long["tags_chars"] <= MAX_CAPTION_CHARS and long["tags"][:2] == ["tag", "tag"]
    assert long["nl_chars"] == MAX_CAPTION_CHARS and long["caption_nl"] == "a" * MAX_CAPTION_CHARS
    assert long["json_chars"] <= MAX_CAPTION_CHARS
    assert json.loads(long["json"])["source"] == "web"
    assert json.loads(long["json"])["description"].startswith("ddd")
    warned = [w for w in stats.warnings if w["locator"] == "5_set/long.png"]
    assert {w["warning"].split(" ")[0] for w in warned} == {"tags", "caption_nl", "json"}
    assert sum("5_set/long.png" in m and "max_caption_chars" in m for m in caplog.messages) == 3
    # an unchanged broken file is reported again without being probed again
    _, (again,) = scan(p, tmp_path / "catalog", tmp_path / "report.json")
    assert again.probed == 0 and {r["locator"] for r in again.rejected} == set(expected)


def test_cli_scan_succeeds_and_reports(tmp_path):
    expected = hostile_kohya(tmp_path / "ds")
    params = params_file(tmp_path, [{"source": "kohya", "path": str(tmp_path / "ds")}])
    report = tmp_path / "report.json"
    res = runner.invoke(app, ["scan", "--params", str(params), "--out", str(tmp_path / "catalog"),
                              "--report", str(report)])
    assert res.exit_code == 0, res.output
    assert "Traceback" not in res.output
    assert {r["locator"] for r in report_of(report)["rejected"]} == set(expected)
    assert report_of(report)["live"] == 4


def test_parallel_probe_reports_the_same(tmp_path):
    hostile_kohya(tmp_path / "ds", good=70)  # enough items for the process pool
    reports = []
    for workers in (0, 2):
        p = make_params([{"source": "kohya", "path": str(tmp_path / "ds")}],
                        data={"scan_workers": workers})
        _, (stats,) = scan(p, tmp_path / f"catalog{workers}")
        reports.append((stats.rejected, stats.warnings, stats.live))
    assert reports[0] == reports[1] and reports[0][2] == 71
    strict = make_params([{"source": "kohya", "path": str(tmp_path / "ds")}],
                         data={"scan_workers": 2, "caption_errors": "strict"})
    with pytest.raises(CaptionEncodingError, match=r"badutf8\.txt"):  # raised in a worker
        scan(strict, tmp_path / "strict")


@pytest.mark.parametrize("policy", ["skip", "replace", "strict"])
def test_caption_errors_policy(tmp_path, caplog, policy):
    hostile_kohya(tmp_path / "ds")
    p = make_params([{"source": "kohya", "path": str(tmp_path / "ds")}],
                    data={"caption_errors": policy})
    if policy == "strict":
        with pytest.raises(CaptionEncodingError, match=r"badutf8\.txt: invalid UTF-8 at byte 12"):
            scan(p, tmp_path / "catalog")
        return
    with caplog.at_level(logging.WARNING):
        _, (stats,) = scan(p, tmp_path / "catalog")
    rejected = {r["locator"]: r["error"] for r in stats.rejected}
    if policy == "skip":
        assert "invalid UTF-8 at byte 12" in rejected["5_set/badutf8.png"]
        assert "badutf8.txt" in rejected["5_set/badutf8.png"]
        return
    assert "5_set/badutf8.png" not in rejected
    index = json.loads((tmp_path / "catalog" / "index.json").read_text())
    rows = read_catalog(tmp_path / "catalog" / index[0]["catalog"]).to_pylist()
    (row,) = [r for r in rows if r["locator"] == "5_set/badutf8.png"]
    assert row["live"] and row["tags"] == ["tag one", "caf\ufffd au lait", "\ufffd\ufffd"]
    assert any("badutf8.txt" in m and "U+FFFD" in m for m in caplog.messages)
    assert any("badutf8.txt" in w["warning"] for w in stats.warnings)


def test_cli_strict_fails_with_one_line_naming_the_file(tmp_path):
    hostile_kohya(tmp_path / "ds")
    params = params_file(tmp_path, [{"source": "kohya", "path": str(tmp_path / "ds")}],
                         caption_errors="strict")
    res = runner.invoke(app, ["scan", "--params", str(params), "--out", str(tmp_path / "catalog"),
                              "--report", str(tmp_path / "report.json")])
    assert res.exit_code == 2 and "Traceback" not in res.output
    (line,) = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert "badutf8.txt" in line and "invalid UTF-8" in line and "caption_errors" in line


def test_unreadable_sidecar_permission(tmp_path, monkeypatch):
    """A sidecar the scan may not read (EACCES; faked, as tests may run as root)."""
    write_image(tmp_path / "ds" / "1_x" / "a.png", 16, 16)
    write_image(tmp_path / "ds" / "1_x" / "b.png", 16, 16)
    secret = tmp_path / "ds" / "1_x" / "a.txt"
    secret.write_text("tags")
    real = Path.read_bytes

    def read_bytes(self):
        if self == secret:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    _, (stats,) = scan(make_params([{"source": "kohya", "path": str(tmp_path / "ds")}]),
                       tmp_path / "catalog")
    (bad,) = stats.rejected
    assert bad["locator"] == "1_x/a.png" and str(secret) in bad["error"]
    assert "Permission denied" in bad["error"] and stats.live == 1


# ---- limits: the knobs and what they bound -----------------------------------------------

def test_long_caption_then_plan_stays_bounded(tmp_path):
    d = tmp_path / "ds" / "1_x"
    for i in range(3):
        write_image(d / f"{i}.png", 32, 32, seed=i)
        (d / f"{i}.txt").write_text(f"tag {i}, other")
    (d / "2.txt").write_text(", ".join(f"tag{i:07d}" for i in range(TEN_MB // 12)))  # 10 MB
    params = params_file(tmp_path, [{"source": "kohya", "path": str(tmp_path / "ds")}])
    raw = yaml.safe_load(params.read_text())
    raw["batching"].update(max_tokens=8192, overlong="truncate_text")
    params.write_text(yaml.safe_dump(raw))
    cat, plan = tmp_path / "catalog", tmp_path / "plan"
    res = runner.invoke(app, ["scan", "--params", str(params), "--out", str(cat),
                              "--report", str(tmp_path / "report.json")])
    assert res.exit_code == 0, res.output
    warned = report_of(tmp_path / "report.json")["warnings"]
    assert [w["locator"] for w in warned] == ["1_x/2.png"]
    assert "max_caption_chars" in warned[0]["warning"]
    res = runner.invoke(app, ["plan", "--params", str(params), "--catalog", str(cat),
                              "--out", str(plan)])
    assert res.exit_code == 0, res.output
    captions = pq.read_table(plan / "plan.parquet").column("caption").to_pylist()
    longest = max(len(c) for c in captions)
    assert 10_000 < longest <= MAX_CAPTION_CHARS  # the long caption is planned, capped


def test_max_image_pixels_knob_and_changed_limits_reprobe(tmp_path):
    d = tmp_path / "ds" / "1_x"
    write_image(d / "small.png", 16, 16)
    write_image(d / "big.png", 64, 64)
    (d / "big.txt").write_text("x" * 300)
    p = make_params([{"source": "kohya", "path": str(tmp_path / "ds")}])
    _, (first,) = scan(p, tmp_path / "catalog")
    assert first.live == 2 and not first.warnings
    tight = make_params([{"source": "kohya", "path": str(tmp_path / "ds")}],
                        data={"max_image_pixels": 1000, "max_caption_chars": 100})
    _, (second,) = scan(tight, tmp_path / "catalog")
    assert second.probed == 2  # new limits re-probe every file
    (bad,) = second.rejected
    assert bad["locator"] == "1_x/big.png" and "64x64 = 4,096 pixels" in bad["error"]
    assert "big.png" in bad["error"] and "max_image_pixels = 1,000" in bad["error"]
    _, (third,) = scan(tight, tmp_path / "catalog")
    assert third.probed == 0  # same limits: incremental again


def test_default_limits_leave_a_normal_catalog_byte_identical(tmp_path, kohya_dataset):
    """The knobs at their defaults and the knobs absent write the same catalog files."""
    p = make_params([{"source": "kohya", "path": str(kohya_dataset)}])
    explicit = make_params([{"source": "kohya", "path": str(kohya_dataset)}],
                           data={"max_caption_chars": MAX_CAPTION_CHARS, "caption_errors": "skip",
                                 "max_image_pixels": 178_956_970, "verify_images": True})
    scan(p, tmp_path / "a")
    scan(explicit, tmp_path / "b")
    files = sorted(f.name for f in (tmp_path / "a").iterdir())
    assert files == sorted(f.name for f in (tmp_path / "b").iterdir())
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_cap_captions_bounds_every_field():
    row = Row("x", tags=["a" * 50, "b", "c" * 30], caption_nl="n" * 99, artist="r" * 80,
              json={"k": "v", "long": '"' * 200, "after": 1})
    cap_captions(row, 60)
    assert row.tags == ["a" * 50, "b"] and row.caption_nl == "n" * 60 and row.artist == "r" * 60
    assert row.json["k"] == "v" and "after" not in row.json and row.json["long"].startswith('"')
    assert len(json.dumps(row.json, separators=(",", ":"))) <= 60
    assert len(row.warnings) == 4
    one = Row("y", tags=["t" * 100])
    cap_captions(one, 10)
    assert one.tags == ["t" * 10]


def test_decoder_refuses_a_bomb_swapped_in_after_the_scan(tmp_path, kohya_dataset):
    p = make_params([{"source": "kohya", "path": str(kohya_dataset)}], train={"steps": 4})
    scan(p, tmp_path / "catalog")
    make_plan(p, tmp_path / "catalog", tmp_path / "plan")
    for png in kohya_dataset.rglob("*.png"):
        png.write_bytes(bomb_png())  # every file replaced after the plan
    batches = PlanBatches(tmp_path / "plan", p.data.datasets, p.resolution, tmp_path / "catalog")
    batch = batches.batch(0)
    assert batch.pixels == [] and batch.skipped
    assert all("decompression bomb" in reason for _, reason in batch.skipped)
    with pytest.raises(ValueError, match="above data.max_image_pixels = 100"):
        decode_image(png_bytes(16, 16), (0, 0, 16, 16), (16, 16), False, max_pixels=100)


# ---- the other sources -------------------------------------------------------------------

# each returns the dataset entry and, per rejected row, what its error must name

def _jsonl(tmp_path: Path) -> tuple[dict, dict[str, str]]:
    img = tmp_path / "img"
    for name in ("a.png", "b.png", "c.png"):
        img.mkdir(exist_ok=True)
        (img / name).write_bytes(png_bytes())
    (img / "bomb.png").write_bytes(bomb_png())
    os.symlink("loop.png", img / "loop.png")
    lines = [json.dumps({"image": "img/a.png", "caption": "fine"}).encode(),
             json.dumps({"image": "img/b.png", "caption": "c" * TEN_MB}).encode(),
             b'{"image": "img/c.png", "caption": "caf\xe9"}',
             json.dumps({"image": "img/bomb.png"}).encode(),
             json.dumps({"image": "img/loop.png"}).encode()]
    (tmp_path / "meta.jsonl").write_bytes(b"\n".join(lines))
    return {"source": "jsonl", "path": str(tmp_path / "meta.jsonl")}, {
        "img/c.png": "meta.jsonl:3", "img/bomb.png": "img/bomb.png", "img/loop.png": "img/loop.png"}


def _parquet(tmp_path: Path) -> tuple[dict, dict[str, str]]:
    captions = pa.array([b"fine", b"c" * TEN_MB, b"caf\xe9", b"ok"], pa.binary()).view(pa.string())
    images = [png_bytes(seed=0), png_bytes(seed=1), png_bytes(seed=2), bomb_png()]
    pq.write_table(pa.table({"png": images, "caption": captions}), tmp_path / "t.parquet")
    return ({"source": "parquet", "path": str(tmp_path / "t.parquet"), "bytes_col": "png"},
            {"row:2": "t.parquet row 2 column 'caption'", "row:3": "t.parquet row:3"})


def _webdataset(tmp_path: Path) -> tuple[dict, dict[str, str]]:
    members = {"a.png": png_bytes(seed=0), "a.txt": b"fine",
               "b.png": png_bytes(seed=1), "b.txt": b"t, " * (TEN_MB // 3),
               "c.png": png_bytes(seed=2), "c.txt": b"caf\xe9",
               "d.png": bomb_png(), "e.png": png_bytes(64, 64)[:300]}
    with tarfile.open(tmp_path / "shard-0.tar", "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return {"source": "webdataset", "path": str(tmp_path / "shard-*.tar")}, {
        "c": "shard-0.tar member c.txt", "d": "shard-0.tar member d.png",
        "e": "shard-0.tar member e.png"}


@pytest.mark.parametrize("make", [_jsonl, _parquet, _webdataset], ids=["jsonl", "parquet",
                                                                      "webdataset"])
def test_other_sources_report_and_cap(tmp_path, make):
    entry, bad = make(tmp_path)
    _, (stats,) = scan(make_params([entry]), tmp_path / "catalog")
    errors = {r["locator"]: r["error"] for r in stats.rejected}
    if entry["source"] == "webdataset":  # locators are offsets: key by sample
        index = json.loads((tmp_path / "catalog" / "index.json").read_text())
        rows = read_catalog(tmp_path / "catalog" / index[0]["catalog"]).to_pylist()
        errors = {json.loads(r["extra"])["key"]: r["error"] for r in rows if r["error"]}
    assert set(errors) == set(bad) and stats.live == 2
    for key, error in errors.items():
        assert bad[key] in error, error
        assert any(s in error for s in ("invalid UTF-8", "decompression bomb", "loop",
                                        "truncated")), error
    (warning,) = stats.warnings
    assert "max_caption_chars" in warning["warning"]
    strict = make_params([entry], data={"caption_errors": "strict"})
    with pytest.raises(KohakuError, match="invalid UTF-8"):
        scan(strict, tmp_path / "strict")


def test_moss_shard_catalog_is_limited_on_copy(tmp_path):
    src = tmp_path / "src"
    write_image(src / "small.png", 16, 16)
    write_image(src / "big.png", 64, 64, seed=1)
    (src / "small.txt").write_text("t" * 5000)
    loose = ScanLimits(max_caption_chars=10**6)
    import_to_shards(FolderSource(str(src)), tmp_path / "shards", loose)
    entry = {"source": "moss_shard", "path": str(tmp_path / "shards")}
    _, (as_is,) = scan(make_params([entry]), tmp_path / "a")
    own = (tmp_path / "shards" / "catalog.parquet").read_bytes()
    assert as_is.live == 2 and not as_is.warnings and not as_is.rejected
    assert (tmp_path / "a" / json.loads((tmp_path / "a" / "index.json").read_text())[0]["catalog"]
            ).read_bytes() == own  # nothing over a limit: copied byte for byte
    tight = make_params([entry], data={"max_caption_chars": 1000, "max_image_pixels": 1000})
    _, (limited,) = scan(tight, tmp_path / "b")
    assert [r["locator"] for r in limited.rejected] == ["0:0"]  # big.png, the first imported
    assert "max_image_pixels" in limited.rejected[0]["error"]
    (warning,) = limited.warnings
    assert "tags has 5,000 characters" in warning["warning"]


def test_scan_limits_pickle_into_probes(tmp_path):
    """Probes carry their limits into spawn workers (they are partials of plain data)."""
    write_image(tmp_path / "a.png", 8, 8)
    (item,) = FolderSource(str(tmp_path)).walk(ScanLimits(max_image_pixels=10))
    (row,) = pickle.loads(pickle.dumps(item.probe))()
    assert "max_image_pixels = 10" in row.error
