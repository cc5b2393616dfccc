"""The caches, the plan and the catalogs under faults.

- The cache manifests are a function of what the caches hold: byte-identical after an
  uninterrupted fill, a killed-and-resumed one, a re-run with everything cached, a fill
  that re-encoded a corrupt shard, another shard size, a lost index.
- Every read is verified: flipped bytes or a truncated shard, a garbage index, a damaged
  plan or catalog are one-line ``IntegrityError`` s naming the file and the command that
  rebuilds it (the CLI exits 2 without a traceback); the fill re-encodes the bad shard.
- Two fills of one directory at once: one waits for the other's lock, nothing is encoded
  twice, no orphan shard is left; stale temp files are swept; files 0644, folders 0755.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from kohakumoss.cache import build as build_mod
from kohakumoss.cache.build import build_latent_cache, build_text_cache, text_identity, vae_identity
from kohakumoss.cache.lookup import BatchCaches
from kohakumoss.cache.store import INDEX, TensorStore
from kohakumoss.params import load_params
from kohakumoss.data.catalogset import load_catalogs
from kohakumoss.data.loader import PlanBatches
from kohakumoss.data.planfile import make_plan, read_plan
from kohakumoss.data.scan import scan
from kohakumoss.encoders import VAE, TextEncoder
from kohakumoss.errors import IntegrityError
from kohakumoss.training.encode import BatchEncoder

from conftest import BASE, make_kohya

KMOSS = Path(sys.executable).with_name("kmoss")
SHARD_BYTES = 6 << 10  # several shards per cache (the smallest cache.shard_mb is 1 MiB)
KINDS = {"text": ("cache_text", TextEncoder), "lat": ("cache_latents", VAE)}


def _write_params(root: Path, ds: Path) -> Path:
    raw = copy.deepcopy(BASE)
    raw["data"]["datasets"] = [{"source": "kohya", "path": str(ds)}]
    raw["caption"].update(tokenizer="tiny", text_drop=0.3)
    raw["batching"].update(max_tokens=400)
    raw.update(encoders={"device": "cpu", "text_dtype": "fp32", "vae_dtype": "fp32", "vae_batch": 3,
                         "text_batch": 4},
               cache={"dtype": "fp32", "shard_mb": 1}, train={"steps": 12})
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _fill(kind: str, p, root: Path, out: Path):
    if kind == "text":
        return build_text_cache(p, root / "plan", out)
    return build_latent_cache(p, root / "plan", root / "catalog", out)


def _shards(d: Path) -> list[Path]:
    return sorted(d.glob("shard-*.safetensors"))


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """A scanned, planned dataset and its two caches, filled once without a fault."""
    root = tmp_path_factory.mktemp("ref")
    ds = make_kohya(root / "ds", {"3_alpha": [(64, 64), (96, 48), (48, 96), (80, 60)],
                                  "1_beta": [(128, 32), (40, 40), (70, 90)]})
    params = _write_params(root, ds)
    p = load_params(params)
    scan(p, root / "catalog")
    make_plan(p, root / "catalog", root / "plan")
    manifests = {}
    with pytest.MonkeyPatch.context() as mp:
        _small_shards(mp)
        for kind in KINDS:
            _, s = _fill(kind, p, root, root / kind)
            assert s.encoded == s.wanted and len(_shards(root / kind)) >= 3
            manifests[kind] = (root / kind / "manifest.json").read_bytes()
    return root, p, manifests


def _small_shards(mp) -> None:
    real = TensorStore
    mp.setattr(build_mod, "TensorStore", lambda d, s, b, **k: real(d, s, SHARD_BYTES, **k))


@pytest.fixture
def work(ref, tmp_path, monkeypatch):
    """A copy of the reference caches to damage; fills write small shards."""
    root, p, manifests = ref
    for kind in KINDS:
        shutil.copytree(root / kind, tmp_path / kind)
    _small_shards(monkeypatch)
    return root, p, manifests, tmp_path


def manifests_entries(manifest: bytes) -> int:
    return json.loads(manifest)["info"]["entries"]


def _flip16(path: Path) -> None:
    """Flip 16 bytes spread over the tensor data of a safetensors file (not its header)."""
    raw = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little")
    for i in range(16):
        raw[start + (len(raw) - start - 1) * i // 15] ^= 0xFF
    path.write_bytes(bytes(raw))


def _read_everything(kind: str, root: Path, p, cache_dir: Path) -> int:
    """Read every batch of the plan the way the trainer does (BatchEncoder, offline)."""
    cs = load_catalogs(root / "catalog", p.data.datasets)
    caches = BatchCaches(p, cs, cache_dir if kind == "text" else root / "none",
                         cache_dir if kind == "lat" else root / "none", text_identity(p), vae_identity(p))
    enc = BatchEncoder(p, caches, torch.device("cpu"))
    batches = PlanBatches(root / "plan", p.data.datasets, p.resolution, root / "catalog", pixels=False)
    n = 0
    for i in range(len(batches)):
        out = enc.texts(batches.batch(i)) if kind == "text" else enc.latents(batches.batch(i))
        n += len(out)
    return n


# -- the manifest is a function of the content --------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_manifest_is_byte_identical_however_the_fill_went(work, kind, monkeypatch):
    root, p, manifests, tmp = work
    want = manifests[kind]
    # everything cached: nothing encoded, the encoder never loaded
    _, s = _fill(kind, p, root, tmp / kind)
    assert s.encoded == 0 and (tmp / kind / "manifest.json").read_bytes() == want
    # killed by the first encoder call after a shard was written, then resumed
    encoder = KINDS[kind][1]
    real = encoder.encode

    def dying(self, *a, **k):
        if _shards(tmp / "killed"):
            raise KeyboardInterrupt("killed")
        return real(self, *a, **k)

    monkeypatch.setattr(encoder, "encode", dying)
    with pytest.raises(KeyboardInterrupt):
        _fill(kind, p, root, tmp / "killed")
    kept = len(TensorStore(tmp / "killed", "fp32"))
    assert 0 < kept < manifests_entries(want)
    monkeypatch.setattr(encoder, "encode", real)
    _, s = _fill(kind, p, root, tmp / "killed")
    assert s.cached == kept and s.encoded == s.wanted - kept
    assert (tmp / "killed" / "manifest.json").read_bytes() == want
    # another shard layout altogether: one big shard
    monkeypatch.setattr(build_mod, "TensorStore", TensorStore)
    _fill(kind, p, root, tmp / "one")
    assert len(_shards(tmp / "one")) == 1 and (tmp / "one" / "manifest.json").read_bytes() == want


@pytest.mark.parametrize("kind", KINDS)
def test_flipped_bytes_fail_the_training_read_and_the_fill_re_encodes_them(work, kind, caplog):
    root, p, manifests, tmp = work
    stage = KINDS[kind][0]
    victim = _shards(tmp / kind)[1]
    _flip16(victim)
    with pytest.raises(IntegrityError) as e:
        _read_everything(kind, root, p, tmp / kind)
    msg = str(e.value)
    assert str(victim) in msg and f"kmoss {stage}" in msg and "dvc repro" in msg and "\n" not in msg
    with caplog.at_level(logging.WARNING):
        _, s = _fill(kind, p, root, tmp / kind)
    assert s.dropped_shards == [victim.name] and 0 < s.encoded < s.wanted
    assert victim.name in caplog.text
    assert (tmp / kind / "manifest.json").read_bytes() == manifests[kind]  # the same bytes again
    assert _read_everything(kind, root, p, tmp / kind) > 0


@pytest.mark.parametrize("kind", KINDS)
def test_truncated_or_missing_shard(work, kind):
    root, p, manifests, tmp = work
    first, second = _shards(tmp / kind)[:2]
    first.write_bytes(first.read_bytes()[:-100])
    with pytest.raises(IntegrityError, match=f"{re.escape(str(first))} is truncated"):
        _read_everything(kind, root, p, tmp / kind)
    _, s = _fill(kind, p, root, tmp / kind)
    assert s.dropped_shards == [first.name]
    second.unlink()
    with pytest.raises(IntegrityError, match=f"{re.escape(str(second))} is missing"):
        _read_everything(kind, root, p, tmp / kind)
    _, s = _fill(kind, p, root, tmp / kind)
    assert s.dropped_shards == [second.name]
    assert (tmp / kind / "manifest.json").read_bytes() == manifests[kind]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "inconsistent"])
def test_damaged_index(work, damage):
    root, p, manifests, tmp = work
    index = tmp / "text" / INDEX
    data = index.read_bytes()
    if damage == "truncated":
        index.write_bytes(data[:len(data) // 2])
    elif damage == "garbage":
        index.write_bytes(os.urandom(300))
    else:  # valid JSON that lost an entry
        d = json.loads(data)
        d["entries"].pop(next(iter(d["entries"])))
        index.write_text(json.dumps(d))
    with pytest.raises(IntegrityError) as e:
        _read_everything("text", root, p, tmp / "text")
    assert str(index) in str(e.value) and "kmoss cache_text" in str(e.value)
    _, s = _fill("text", p, root, tmp / "text")
    assert s.encoded == s.wanted  # every shard was dropped with the index, then re-encoded
    assert (tmp / "text" / "manifest.json").read_bytes() == manifests["text"]
    assert {p.name for p in _shards(tmp / "text")} == set(json.loads(index.read_text())["shards"])


def test_index_of_an_older_version_is_upgraded_without_re_encoding(work):
    root, p, manifests, tmp = work
    index = tmp / "text" / INDEX
    d = json.loads(index.read_text())
    d["schema"], d["entries"] = 1, {k: v[:2] for k, v in d["entries"].items()}
    index.write_text(json.dumps(d))
    with pytest.raises(IntegrityError, match="predates per-entry digests.*kmoss cache_text"):
        _read_everything("text", root, p, tmp / "text")
    _, s = _fill("text", p, root, tmp / "text")
    assert s.encoded == 0 and s.dropped_shards == []
    assert json.loads(index.read_text())["schema"] == 2
    assert (tmp / "text" / "manifest.json").read_bytes() == manifests["text"]


def test_stale_temp_files_are_swept_and_never_taken_for_shards(work):
    root, p, manifests, tmp = work
    d = tmp / "text"
    last = _shards(d)[-1]
    stale = [d / f".{last.name}.a1b2c3.tmp", d / ".shard-99999.safetensors.x.tmp",
             d / ".index.json.q9.tmp", d / ".tmp-abc"]
    for f in stale[:3]:
        f.write_bytes(b"half written")
    stale[3].mkdir()
    (d / INDEX).unlink()  # force a re-encode: new shards must not collide with anything
    _fill("text", p, root, d)
    assert not any(f.exists() for f in stale)
    assert (d / "manifest.json").read_bytes() == manifests["text"]
    assert {f.name for f in _shards(d)} == set(json.loads((d / INDEX).read_text())["shards"])


@pytest.mark.parametrize("kind", ["text", "lat"])
def test_a_training_run_on_a_damaged_cache_stops_naming_the_shard(tmp_path, kind):
    from kohakumoss.training.trainer import Trainer

    from test_train import _prepare, _write_params

    ds = make_kohya(tmp_path / "ds", {"2_a": [(48, 32), (32, 48), (40, 40)], "1_b": [(64, 32)]})
    params = _write_params(tmp_path, ds, train={"steps": 4})
    paths = _prepare(tmp_path, params)
    shard = _shards(tmp_path / kind)[0]
    _flip16(shard)
    with pytest.raises(IntegrityError, match=re.escape(str(shard))):
        Trainer(load_params(params), paths).run(progress=False)
    assert not paths.checkpoints.exists() or not list(paths.checkpoints.glob("step-*"))


# -- the plan and the catalogs ------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["flipped", "truncated", "not parquet", "missing"])
def test_damaged_plan_is_one_line_naming_the_file(ref, tmp_path, damage):
    root, p, _ = ref
    shutil.copytree(root / "plan", tmp_path / "plan")
    path = tmp_path / "plan" / "plan.parquet"
    raw = path.read_bytes()
    if damage == "flipped":
        path.write_bytes(raw[:100] + bytes(b ^ 0xFF for b in raw[100:116]) + raw[116:])
    elif damage == "truncated":
        path.write_bytes(raw[:len(raw) // 2])
    elif damage == "not parquet":
        path.write_text("batch,slot\n0,0\n")
    else:
        path.unlink()
    with pytest.raises(IntegrityError) as e:
        read_plan(tmp_path / "plan")
    msg = str(e.value)
    assert str(path) in msg and "kmoss plan" in msg and "\n" not in msg
    if damage != "truncated":
        return
    res = subprocess.run([str(KMOSS), "cache_text", "--params", str(root / "params.yaml"), "--plan",
                          str(tmp_path / "plan"), "--out", str(tmp_path / "text")],
                         capture_output=True, text=True)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr and "plan.parquet" in res.stderr and "kmoss plan" in res.stderr
    assert not (tmp_path / "text" / "manifest.json").exists()


def test_damaged_catalog_is_one_line_naming_the_file(ref, tmp_path):
    root, p, _ = ref
    shutil.copytree(root / "catalog", tmp_path / "catalog")
    index = json.loads((tmp_path / "catalog" / "index.json").read_text())
    path = tmp_path / "catalog" / index[0]["catalog"]
    path.write_bytes(path.read_bytes()[:-50])
    with pytest.raises(IntegrityError) as e:
        load_catalogs(tmp_path / "catalog", p.data.datasets)
    assert str(path) in str(e.value) and "kmoss scan" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(IntegrityError, match="kmoss scan"):
        make_plan(p, tmp_path / "catalog", tmp_path / "plan")


# -- two writers ----------------------------------------------------------------------------------
WORKER = """
import json, logging, sys, time
from pathlib import Path
logging.basicConfig(level=logging.INFO)
from kohakumoss.cache.build import build_text_cache
from kohakumoss.params import load_params
from kohakumoss.encoders import TextEncoder

real = TextEncoder.encode
def slow(self, *a, **k):
    time.sleep(0.2)
    return real(self, *a, **k)
TextEncoder.encode = slow
me, other = Path(sys.argv[4]), Path(sys.argv[5])
me.touch()
while not other.exists():  # both fills start together
    time.sleep(0.01)
_, s = build_text_cache(load_params(sys.argv[1]), sys.argv[2], sys.argv[3])
print(json.dumps({"wanted": s.wanted, "cached": s.cached, "encoded": s.encoded}))
"""


def test_two_fills_at_once_encode_each_entry_once(ref, tmp_path):
    root, p, manifests = ref
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "text"
    procs = [subprocess.Popen([sys.executable, str(script), str(root / "params.yaml"), str(root / "plan"),
                               str(out), str(tmp_path / f"ready{i}"), str(tmp_path / f"ready{1 - i}")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    results = [proc.communicate(timeout=300) for proc in procs]
    for proc, (stdout, stderr) in zip(procs, results):
        assert proc.returncode == 0, stderr
    stats = [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in results]
    wanted = stats[0]["wanted"]
    assert sum(s["encoded"] for s in stats) == wanted  # nothing encoded twice
    assert sorted(s["cached"] for s in stats) == [0, wanted]  # the second found it all cached
    assert any("being written by another cache_text" in stderr for _, stderr in results)
    index = json.loads((out / INDEX).read_text())
    assert {f.name for f in _shards(out)} == set(index["shards"])  # no orphan shard
    assert len(index["entries"]) == wanted
    assert not [f for f in out.iterdir() if f.name.endswith(".tmp")]
    assert (out / "manifest.json").read_bytes() == manifests["text"]


def test_online_write_back_waits_for_a_fill_and_stores_nothing_twice(ref, tmp_path):
    import threading
    import time

    from kohakumoss.artifacts import dir_lock

    store_a = TensorStore(tmp_path / "c", "fp32", stage="cache_text")
    store_b = TensorStore(tmp_path / "c", "fp32", stage="cache_text")  # opened before A wrote
    held, release = threading.Event(), threading.Event()

    def other_writer():
        with dir_lock(tmp_path / "c", "cache_text"):
            held.set()
            release.wait(5)

    t = threading.Thread(target=other_writer)
    t.start()
    held.wait(5)
    store_a.add("a" * 32, torch.ones(2, 3))
    timer = threading.Timer(0.5, release.set)
    timer.start()
    t0 = time.perf_counter()
    store_a.flush()  # waits for the other writer's lock
    assert time.perf_counter() - t0 >= 0.4
    t.join()
    store_b.add("a" * 32, torch.zeros(2, 3))  # B still believes "a" is missing
    store_b.add("b" * 32, torch.ones(1, 3))
    store_b.flush()
    fresh = TensorStore(tmp_path / "c", "fp32")
    assert fresh.lengths() == {"a" * 32: 2, "b" * 32: 1} and len(_shards(tmp_path / "c")) == 2
    assert torch.equal(fresh.get("a" * 32, torch.float32), torch.ones(2, 3))  # A's, kept


# -- modes ----------------------------------------------------------------------------------------
def test_files_are_0644_and_folders_0755(ref, tmp_path):
    root, p, _ = ref
    old = os.umask(0o022)
    try:
        make_plan(p, root / "catalog", tmp_path / "plan")
        build_text_cache(p, tmp_path / "plan", tmp_path / "cache" / "text")
        build_latent_cache(p, tmp_path / "plan", root / "catalog", tmp_path / "cache" / "lat")
    finally:
        os.umask(old)
    seen = 0
    for path in [tmp_path / "plan", tmp_path / "cache", *(tmp_path / "plan").rglob("*"),
                 *(tmp_path / "cache").rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o755 if path.is_dir() else 0o644), (path, oct(mode))
        seen += 1
    assert seen > 10
