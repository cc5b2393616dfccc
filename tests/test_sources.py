"""Data sources (docs/data.md#the-row-model, docs/data.md#sources,
docs/data.md#image-identity) on tiny images generated in tmp_path."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from kohakumoss.configlib import ConfigError, build
from kohakumoss.data.sources import SOURCES, SourceError, shards
from kohakumoss.data.sources.base import content_hash
from kohakumoss.data.sources.folder import FolderSource
from kohakumoss.data.sources.jsonl import JsonlSource
from kohakumoss.data.sources.kohya import KohyaSource
from kohakumoss.data.sources.parquet import ParquetSource
from kohakumoss.data.sources.shards import MossShardSource, ShardWriter, write_shards
from kohakumoss.data.sources.webdataset import WebdatasetSource


def png(size=(8, 6), mode="RGB", **save) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, "PNG", **save)
    return buf.getvalue()


def put(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def put_all(root: Path, files: dict[str, bytes | str]) -> None:
    for name, data in files.items():
        put(root / name, data)


def rows_of(source) -> list:
    return [row for item in source.walk() for row in item.probe()]


def by_loc(source) -> dict:
    return {row.locator: row for row in rows_of(source)}


def exif_jpeg(path: Path, size: tuple[int, int], orientation: int | None) -> None:
    exif = Image.Exif()
    if orientation is not None:
        exif[0x0112] = orientation
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size).save(path, "JPEG", exif=exif)


def touch_later(path: Path) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))


@pytest.fixture
def kohya_dir(tmp_path: Path) -> Path:
    root = tmp_path / "ds"
    put_all(root, {"10_alice/b.png": png((10, 4)), "10_alice/a.png": png((4, 10)),
                   "10_alice/deeper/x.png": png(),  # second level: not read
                   "2_5_bob_style/c.jpg": png(),  # PIL reads by content, not by name
                   "plain/d.webp": png(), "plain/notes.txt": "orphan", "root.png": png()})
    return root


def test_kohya_order_weights_groups(kohya_dir: Path) -> None:
    rows = rows_of(KohyaSource(str(kohya_dir)))
    assert [r.locator for r in rows] == ["10_alice/a.png", "10_alice/b.png",
                                         "2_5_bob_style/c.jpg", "plain/d.webp"]
    assert [r.weight for r in rows] == [10.0, 10.0, 2.0, 1.0]
    assert [r.group for r in rows] == ["10_alice", "10_alice", "2_5_bob_style", "plain"]
    assert (rows[0].w, rows[0].h) == (4, 10) and all(r.artist is None for r in rows)
    assert rows[0].extra["hash"].startswith("stat:")


@pytest.mark.parametrize("arg, rule, field, expected", [
    ("repeat_prefix", "first", "weight", [10.0, 2.0, 1.0]),
    ("repeat_prefix", "product", "weight", [10.0, 10.0, 1.0]),
    ("repeat_prefix", "ignore", "weight", [1.0, 1.0, 1.0]),
    ("artist_from_folder", None, "artist", [None, None, None]),
    ("artist_from_folder", "name", "artist", ["alice", "bob_style", "plain"]),
    ("artist_from_folder", r"(\w+)_style", "artist", [None, "bob", None]),
    ("artist_from_folder", "b.b", "artist", [None, "bob", None])])
def test_kohya_folder_name_rules(kohya_dir: Path, arg, rule, field, expected) -> None:
    rows = {r.group: getattr(r, field) for r in rows_of(KohyaSource(str(kohya_dir), **{arg: rule}))}
    assert [rows["10_alice"], rows["2_5_bob_style"], rows["plain"]] == expected


def test_kohya_include_root(kohya_dir: Path) -> None:
    rows = rows_of(KohyaSource(str(kohya_dir), include_root=True, artist_from_folder="name"))
    assert len(rows) == 5 and rows[0].locator == "root.png"
    assert (rows[0].group, rows[0].weight, rows[0].artist) == ("", 1.0, None)


def test_sidecar_precedence(tmp_path: Path) -> None:
    put_all(tmp_path / "1_x", {
        "a.png": png(), "a.txt": " tag one, , tag two ,",
        "b.png": png(), "b.txt": "from txt", "b.caption": "from caption",
        "c.png": png(), "c.txt": "t1, t2", "c.caption": "from caption"})
    put(tmp_path / "1_x" / "c.json", json.dumps({
        "tags": "j1, j2", "caption_nl": "nl wins", "text": "t", "caption": "c",
        "artist": "ann", "rating": "safe", "score": 7}))
    rows = by_loc(KohyaSource(str(tmp_path)))
    assert (rows["1_x/a.png"].tags, rows["1_x/a.png"].caption_nl) == (["tag one", "tag two"], None)
    assert (rows["1_x/b.png"].tags, rows["1_x/b.png"].caption_nl) == (["from txt"], "from caption")
    c = rows["1_x/c.png"]
    assert (c.tags, c.caption_nl, c.artist, c.rating, c.json) == (
        ["j1", "j2"], "nl wins", "ann", "safe", {"score": 7})
    nl = by_loc(FolderSource(str(tmp_path), txt_as="nl"))
    assert (nl["1_x/a.png"].caption_nl, nl["1_x/a.png"].tags) == ("tag one, , tag two ,", None)


def test_folder_recursive_order_and_symlinks(tmp_path: Path) -> None:
    root = tmp_path / "f"
    put_all(root, {"z.png": png(), "a/b/deep.png": png(), "a/one.png": png(), "m.png": png()})
    put(tmp_path / "elsewhere" / "linked.png", png())
    os.symlink(tmp_path / "elsewhere", root / "link")
    rows = rows_of(FolderSource(str(root)))
    assert [r.locator for r in rows] == ["m.png", "z.png", "a/one.png", "a/b/deep.png"]
    assert [r.group for r in rows] == ["", "", "a", "a/b"]
    flat = rows_of(FolderSource(str(root), recursive=False))
    assert [r.locator for r in flat] == ["m.png", "z.png"]


def test_exif_orientation_swaps(tmp_path: Path) -> None:
    exif_jpeg(tmp_path / "rot.jpg", (40, 20), 6)
    exif_jpeg(tmp_path / "flat.jpg", (40, 20), None)
    rows = by_loc(FolderSource(str(tmp_path)))
    assert [(rows[n].w, rows[n].h) for n in ("rot.jpg", "flat.jpg")] == [(20, 40), (40, 20)]


def test_alpha_detection(tmp_path: Path) -> None:
    put_all(tmp_path, {"rgba.png": png(mode="RGBA"), "la.png": png(mode="LA"),
                       "ptrans.png": png(mode="P", transparency=0), "p.png": png(mode="P"),
                       "rgb.png": png()})
    alpha = {k: r.has_alpha for k, r in by_loc(FolderSource(str(tmp_path))).items()}
    assert alpha == {"la.png": True, "p.png": False, "ptrans.png": True, "rgb.png": False,
                     "rgba.png": True}


def test_stamps_follow_image_and_sidecars(tmp_path: Path) -> None:
    d = tmp_path / "3_s"
    img, other = put(d / "a.png", png()), put(d / "b.png", png())
    src = KohyaSource(str(tmp_path))

    def stamps() -> tuple[tuple[int, ...], tuple[int, ...]]:
        got = {i.key: i.stamp for i in src.walk()}
        return got["3_s/a.png"], got["3_s/b.png"]

    first, b_stamp = stamps()
    st = img.stat()
    assert first == (st.st_size, st.st_mtime_ns) + (-1,) * 8 and stamps() == (first, b_stamp)
    txt = put(d / "a.txt", "x")
    assert stamps() == (first[:2] + (1, txt.stat().st_mtime_ns) + (-1,) * 6, b_stamp)
    seen = {first, stamps()[0]}
    for change in ("touch txt", ".caption", ".json", ".mask.png", "image"):
        if change == "touch txt":
            touch_later(txt)
        elif change == "image":
            img.write_bytes(png((9, 9)))
            touch_later(img)
        else:
            put(d / f"a{change}", "{}")
        a_stamp, b_now = stamps()
        assert a_stamp not in seen and b_now == b_stamp, change
        seen.add(a_stamp)
    assert other.stat().st_mtime_ns == b_stamp[1]
    assert {i.key for i in src.walk()} == {"3_s/a.png", "3_s/b.png"}  # a loss mask is no image


def test_hash_content_is_location_independent(tmp_path: Path) -> None:
    data = put(tmp_path / "a" / "x.png", png()).read_bytes()
    put(tmp_path / "b" / "y.png", data)
    rows = by_loc(FolderSource(str(tmp_path), hash_content=True))
    assert rows["a/x.png"].extra["hash"] == rows["b/y.png"].extra["hash"] == content_hash(data)


def test_corrupt_images_give_error_rows(tmp_path: Path) -> None:
    put_all(tmp_path, {"random.png": os.urandom(300), "trunc.png": png()[:12], "good.png": png(),
                       "badside.png": png(), "badside.json": "{not json"})
    rows = by_loc(FolderSource(str(tmp_path)))
    for bad in ("random.png", "trunc.png", "badside.png"):
        assert rows[bad].error and (rows[bad].w, rows[bad].h) == (0, 0)
    assert rows["good.png"].error is None


def test_config_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    for src in (KohyaSource(str(missing)), FolderSource(str(missing)),
                JsonlSource(str(missing / "m.jsonl")), ParquetSource(str(missing / "t.parquet")),
                WebdatasetSource(str(missing / "*.tar")), MossShardSource(str(missing))):
        with pytest.raises(SourceError, match="nope"):
            src.walk() if src.name != "moss_shard" else src.own_catalog()
    put(tmp_path / "empty" / "10_x" / "readme.md", "no images")
    with pytest.raises(SourceError, match=r"empty.*path/10_name/img.png \+ img.txt"):
        KohyaSource(str(tmp_path / "empty")).walk()
    with pytest.raises(SourceError, match="somewhere.*txt_as"):
        KohyaSource("somewhere", txt_as="words")
    with pytest.raises(ConfigError, match=r"datasets\[0\]\.txt_as"):
        build(SOURCES["folder"], {"path": "p", "txt_as": "words"}, "data.datasets[0]")


def test_jsonl_records_keys_and_stamps(tmp_path: Path) -> None:
    put(tmp_path / "img" / "a.png", png((5, 7)))
    lines = [json.dumps({"image": "img\\a.png", "weight": 3, "group": "g", "tags": "x, y"}),
             "",
             json.dumps({"file": "img/a.png", "caption": "dup"}),
             json.dumps({"path": "img/missing.png"})]
    manifest = put(tmp_path / "m.jsonl", "\n".join(lines) + "\n")
    items = JsonlSource(str(manifest)).walk()
    assert [i.key for i in items] == ["img/a.png#0", "img/a.png#1", "img/missing.png#0"]
    st = (tmp_path / "img" / "a.png").stat()
    digest = hashlib.blake2b(lines[0].encode(), digest_size=8).digest()
    line_hash = int.from_bytes(digest, "big") >> 1
    assert items[0].stamp == (st.st_size, st.st_mtime_ns, line_hash, 0) + (-1,) * 6
    assert items[2].stamp[:2] == (-1, -1)
    rows = [i.probe()[0] for i in items]
    assert (rows[0].w, rows[0].h, rows[0].weight, rows[0].group, rows[0].tags) == (
        5, 7, 3.0, "g", ["x", "y"])
    assert rows[1].caption_nl == "dup" and rows[1].weight == 1.0
    assert rows[2].error.startswith("file not found: ")
    put(tmp_path / "bad.jsonl", '{"image": "a.png"}\n{"caption": "no image"}\n')
    with pytest.raises(SourceError, match=r"bad.jsonl:2.*image, file, path, file_name"):
        JsonlSource(str(tmp_path / "bad.jsonl")).walk()
    elsewhere = put(tmp_path / "meta" / "m.jsonl", '{"file_name": "a.png"}\n')
    assert rows_of(JsonlSource(str(elsewhere), root=str(tmp_path / "img")))[0].error is None


def table_bytes(columns: dict, row_group_size: int | None = None) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table(columns), buf, row_group_size=row_group_size)
    return buf.getvalue()


def test_parquet_path_mode(tmp_path: Path) -> None:
    put(tmp_path / "a.png", png((3, 4)))
    table = put(tmp_path / "t.parquet", table_bytes({
        "image": ["a.png", "a.png"], "weight": [2.0, None], "group": [None, "g"],
        "caption": ["hi", None], "score": [1, 2]}))
    items = ParquetSource(str(table)).walk()
    assert [i.key for i in items] == ["a.png#0", "a.png#1"]
    assert items[0].stamp[2] != items[1].stamp[2] and items[0].stamp[3:] == (0,) + (-1,) * 6
    rows = [i.probe()[0] for i in items]
    assert (rows[0].weight, rows[0].group, rows[0].caption_nl, rows[0].json) == (
        2.0, "", "hi", {"score": 1})
    assert (rows[1].weight, rows[1].group, rows[1].caption_nl) == (1.0, "g", None)
    with pytest.raises(SourceError, match="image_col 'img'.*columns: image"):
        ParquetSource(str(table), image_col="img").walk()


def test_parquet_bytes_mode(tmp_path: Path) -> None:
    images = [png((i + 2, 3)) for i in range(5)]
    images[3] = b"garbage"
    table = put(tmp_path / "b.parquet", table_bytes({
        "jpg": images, "image": ["ignored"] * 5, "tags": ["a, b"] * 5}, row_group_size=2))
    src = ParquetSource(str(table), bytes_col="jpg")
    (item,) = src.walk()
    assert item.key == f"file:{table.absolute()}" and item.stamp[2:] == (-1,) * 8
    rows = item.probe()
    assert [r.locator for r in rows] == [f"row:{i}" for i in range(5)]
    assert rows[3].error and rows[0].json is None and rows[0].tags == ["a", "b"]
    for i in (4, 0, 2):
        assert src.open(f"row:{i}") == images[i]
        assert rows[i].extra["hash"] == content_hash(images[i])
    with pytest.raises(SourceError, match="bytes_col 'png'"):
        ParquetSource(str(table), bytes_col="png").walk()


def tar_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_webdataset_grouping(tmp_path: Path) -> None:
    put(tmp_path / "s-1.tar", tar_bytes({"x.png": png((2, 2))}))
    put(tmp_path / "s-0.tar", tar_bytes({
        "a.seg.png": png((6, 5)), "a.txt": b"t1, t2", "b.jpg": png((7, 3)), "b.PNG": png(),
        "b.json": b'{"caption": "cap", "src": "web"}', "c.txt": b"orphan",
        "dir/d.png": png((4, 4))}))
    src = WebdatasetSource(str(tmp_path / "s-*.tar"))
    items = src.walk()
    assert [i.key for i in items] == [f"tar:{tmp_path / n}" for n in ("s-0.tar", "s-1.tar")]
    assert items[1].stamp[0] == 1 and items[1].stamp[3:] == (-1,) * 7
    rows = {r.extra["key"]: r for r in items[0].probe()}
    assert sorted(rows) == ["a", "b", "dir/d"]
    a = rows["a"]
    assert ((a.w, a.h), a.tags, a.group) == ((6, 5), ["t1", "t2"], "s-0.tar")
    assert (rows["b"].w, rows["b"].caption_nl, rows["b"].json) == (7, "cap", {"src": "web"})
    tar_ids = [r.locator.split(":")[0] for r in [*rows.values(), *items[1].probe()]]
    assert tar_ids == ["0", "0", "0", "1"]
    with pytest.raises(SourceError, match="nothing-"):
        WebdatasetSource(str(tmp_path / "nothing-*.tar")).walk()


WIDE, TALL = png((9, 5)), png((2, 7), mode="RGBA")
ROUND_TRIP = {  # name -> (files to write, source over tmp_path)
    "kohya": ({"5_k/a.png": WIDE, "5_k/b.png": TALL}, lambda t: KohyaSource(str(t))),
    "folder": ({"x/a.bmp": WIDE}, lambda t: FolderSource(str(t))),
    "jsonl": ({"a.png": WIDE, "m.jsonl": '{"image": "a.png"}\n{"image": "a.png"}\n'},
              lambda t: JsonlSource(str(t / "m.jsonl"))),
    "parquet_paths": ({"a.png": WIDE, "p.parquet": table_bytes({"image": ["a.png"]})},
                      lambda t: ParquetSource(str(t / "p.parquet"))),
    "parquet_bytes": ({"b.parquet": table_bytes({"b": [WIDE, TALL]})},
                      lambda t: ParquetSource(str(t / "b.parquet"), bytes_col="b")),
    "webdataset": ({"0.tar": tar_bytes({"a.png": WIDE, "b.webp.png": TALL})},
                   lambda t: WebdatasetSource(str(t / "*.tar"))),
}


@pytest.mark.parametrize("name", ROUND_TRIP)
def test_open_decodes_to_probed_size_and_probes_pickle(tmp_path: Path, name: str) -> None:
    files, make = ROUND_TRIP[name]
    put_all(tmp_path, files)
    source = make(tmp_path)
    assert source.own_catalog() is None
    assert pickle.loads(pickle.dumps(source)) == source
    items = source.walk()
    rows = [row for item in items for row in item.probe()]
    assert rows and all(r.error is None and r.extra["hash"] for r in rows)
    for row in rows:
        with Image.open(io.BytesIO(source.open(row.locator))) as im:
            assert im.size == (row.w, row.h)
    for item in items:
        assert pickle.loads(pickle.dumps(item.probe))() == item.probe()


def test_shard_index_records_and_rollover(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(shards, "SHARD_BYTES", 200)
    put(tmp_path / "src" / "a.png", png((9, 5), mode="RGBA"))
    exif_jpeg(tmp_path / "src" / "b.jpg", (30, 10), 6)
    put(tmp_path / "src" / "c.png", os.urandom(50))  # probe error: left out
    put(tmp_path / "src" / "d.webp", png((4, 4)))
    source = FolderSource(str(tmp_path / "src"))
    rows = write_shards(source, tmp_path / "ds" / "shards")
    assert [r.extra["origin"] for r in rows] == ["a.png", "b.jpg", "d.webp"]
    sizes = [len(source.open(r.extra["origin"])) for r in rows]
    assert sizes[0] < 200 < sizes[1]  # the JPEG alone passes the limit: one shard each
    assert [r.locator for r in rows] == ["0:0", "1:0", "2:0"]
    files = sorted(p.name for p in (tmp_path / "ds" / "shards").iterdir())
    assert files == [f"0000{i}.{ext}" for i in range(3) for ext in ("bin", "idx")]
    reader = MossShardSource(str(tmp_path / "ds"))

    def le(raw: bytes) -> int:
        return int.from_bytes(raw, "little")

    for row, size in zip(rows, sizes):
        shard, index = (int(v) for v in row.locator.split(":"))
        base = tmp_path / "ds" / "shards" / f"{shard:05d}"
        raw = base.with_suffix(".idx").read_bytes()[index * 32:(index + 1) * 32]
        data = reader.open(row.locator)
        digest = content_hash(data)
        assert row.extra["hash"] == digest and data == source.open(row.extra["origin"])
        assert (le(raw[8:12]), le(raw[12:14]), le(raw[14:16])) == (size, row.w, row.h)
        assert raw[16] == {"a.png": 2, "b.jpg": 1, "d.webp": 3}[row.extra["origin"]]
        assert raw[17] == int(row.has_alpha) and raw[18:24] == bytes(6)
        assert le(raw[24:32]) == int(digest[:16], 16)
        assert base.with_suffix(".bin").read_bytes()[le(raw[0:8]):le(raw[0:8]) + size] == data
    with pytest.raises(SourceError, match="own catalog"):
        reader.walk()
    with pytest.raises(SourceError, match="catalog.parquet"):
        reader.own_catalog()


def test_shard_writer_rolls_only_when_non_empty(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(shards, "SHARD_BYTES", 10)
    with ShardWriter(tmp_path) as writer:
        locs = [writer.append(b"x" * n, 1, 1, 0, False, "0" * 32) for n in (30, 4, 6, 1)]
    assert locs == ["0:0", "1:0", "1:1", "2:0"]
    assert (tmp_path / "00001.idx").stat().st_size == 64


def test_import_to_shards(tmp_path: Path) -> None:
    catalog = pytest.importorskip("kohakumoss.data.catalog")
    if not hasattr(catalog, "write_rows_catalog"):
        pytest.skip("kohakumoss.data.catalog.write_rows_catalog not written yet")
    from kohakumoss.data.sources import import_to_shards

    put_all(tmp_path / "k", ROUND_TRIP["kohya"][0])
    source = KohyaSource(str(tmp_path / "k"))
    path = import_to_shards(source, tmp_path / "ds")
    assert path == tmp_path / "ds" / "catalog.parquet" and path.is_file()
    assert MossShardSource(str(tmp_path / "ds")).own_catalog() == path
    with pytest.raises(SourceError, match="already holds shards"):
        import_to_shards(source, tmp_path / "ds")
