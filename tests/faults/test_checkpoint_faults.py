"""Checkpoints under faults: no pickle is ever loaded, every read is verified, and a damaged
newest checkpoint is skipped (moved aside, with a warning naming it) so the run resumes from
the previous one and still ends bit-identical to a run that never stopped."""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from kohakumoss.artifacts import hash_file
from kohakumoss.params import load_params
from kohakumoss.errors import IntegrityError, KohakuError, user_message
from kohakumoss.export.formats import load_source
from kohakumoss.formats import checkpoint as ckpt_mod
from kohakumoss.formats.checkpoint import (Checkpoint, LegacyCheckpointError, list_checkpoints,
                                            load_newest, open_checkpoint, save_checkpoint)
from kohakumoss.training.ema import EMA
from kohakumoss.training.optim import CombinedOptimizer, build_optimizer, build_scheduler
from kohakumoss.formats.statefile import (dumps_state, flatten_state, loads_state,
                                           unflatten_state)
from kohakumoss.training.trainer import RunPaths, Trainer

from conftest import ROOT, make_kohya
from test_optim import _cfg
from test_train import _prepare, _write_params

FILES = ["trainable.safetensors", "ema.safetensors", "optimizer.safetensors", "optimizer.json",
         "state.json"]


# -- the flatten helper ------------------------------------------------------------------------
def _same(a, b, path="") -> None:
    """Equal in type, structure, key order, dtype, shape and every bit."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        bits = [t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
        assert torch.equal(*bits), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b and repr(a) == repr(b), path


def _through_files(obj, tmp: Path):
    """flatten -> optimizer.safetensors + optimizer.json -> unflatten, as a checkpoint does."""
    tensors, tree = flatten_state(obj)
    save_file(tensors, str(tmp / "t.safetensors"))
    (tmp / "t.json").write_text(dumps_state(tree))
    return unflatten_state(loads_state((tmp / "t.json").read_text()), load_file(str(tmp / "t.safetensors")))


def test_flatten_round_trip_is_exact(tmp_path):
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    obj = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 3)},
                  7: {"momentum_buffer": torch.randn(4, dtype=torch.float64)}},
        "groups": [{"betas": (0.9, 0.999), "ns": (3.4445, -4.775, 2.0315), "fused": None,
                    "amsgrad": False, "params": [0, 7], "names": ["a.weight", "b"]}],
        "floats": [float("inf"), float("-inf"), float("nan"), -0.0, 1e-300, 0.1, 1.0, 2.0**60],
        "ints": [0, -1, 2**70, True, False],
        "$tagged": {"$tensor": "not a tensor", "ü/ key": "välue"},
        "mixed": {1: "one", "1": "string one"},
        "nested": ((1, [2, (3,)]), [], (), {}),
        "tensors": [torch.get_rng_state(), torch.tensor(True), torch.zeros(0, 3),
                    torch.randn(5).to(torch.bfloat16), torch.tensor([1, 2], dtype=torch.int8),
                    torch.tensor(7, dtype=torch.int64), torch.tensor([-0.0, float("nan")]),
                    base[:, 1], base[1]],  # two views of one storage, one not contiguous
        None: None,
    }
    with pytest.raises(TypeError, match="only int and str keys"):
        flatten_state(obj)
    del obj[None]
    obj["none"] = None
    _same(obj, _through_files(obj, tmp_path))
    tensors, tree = flatten_state({"state": obj["state"]})  # readable: a JSON object, paths
    assert "state/0/exp_avg" in tensors and tree["state"] == {"$dict": [
        [0, {"step": {"$tensor": "state/0/step"}, "exp_avg": {"$tensor": "state/0/exp_avg"}}],
        [7, {"momentum_buffer": {"$tensor": "state/7/momentum_buffer"}}]]}
    text = dumps_state(flatten_state(obj)[1])
    assert "NaN" not in text and "Infinity" not in text


@pytest.mark.parametrize("bad, where", [({"a": [1, {2.5}]}, "a/1"), ({"x": torch.float32}, "x"),
                                        ({(1, 2): 3}, "top level")])
def test_flatten_refuses_what_it_cannot_restore(bad, where):
    with pytest.raises(TypeError, match=where):
        flatten_state(bad)


class _Net(torch.nn.Module):
    """Two "repeated block" matrices (Muon's share) and a head (AdamW's)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return self.head(x)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_optimizer_schedule_ema_rng_round_trip_is_bit_identical(tmp_path, name):
    cfg = _cfg(name=name, lr=2e-3, muon_lr=0.02, weight_decay=0.05, warmup_steps=2,
               schedule="cosine", min_lr_ratio=0.1)

    def fresh():
        model = _Net()
        opt = build_optimizer(list(model.named_parameters()), cfg)
        return model, opt, build_scheduler(opt, cfg, 8), EMA(list(model.named_parameters()), 0.9)

    def train(model, opt, sched, ema, steps):
        for s in steps:
            g = torch.Generator().manual_seed(s)
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            ema.update()

    model, opt, sched, ema = fresh()
    assert isinstance(opt, CombinedOptimizer) == (name == "muon")
    train(model, opt, sched, ema, range(4))
    ema_counters = {k: v for k, v in ema.state_dict().items() if k != "shadow"}
    extra = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "ema": ema_counters,
             "rng": {"torch": torch.get_rng_state(), "cuda": [torch.get_rng_state()]}}
    path = save_checkpoint(tmp_path, 4, model.state_dict(), extra, {"trained": {}}, ema=ema.shadow)
    assert not list(path.glob("*.pt"))
    expect_rand = torch.rand(5)

    data = open_checkpoint(path).load()
    _same(extra, data.extra)
    model2, opt2, sched2, ema2 = fresh()
    train(model2, opt2, sched2, ema2, range(1))  # loading must overwrite this
    model2.load_state_dict(data.trainable)
    opt2.load_state_dict(data.extra["optimizer"])
    sched2.load_state_dict(data.extra["scheduler"])
    ema2.load_state_dict({**data.extra["ema"], "shadow": data.ema})
    torch.set_rng_state(data.extra["rng"]["torch"])
    assert torch.equal(torch.rand(5), expect_rand)

    train(model, opt, sched, ema, range(4, 8))
    train(model2, opt2, sched2, ema2, range(4, 8))
    _same(model.state_dict(), model2.state_dict())
    _same(opt.state_dict(), opt2.state_dict())
    _same(sched.state_dict(), sched2.state_dict())
    _same(ema.state_dict(), ema2.state_dict())
    if name == "muon":
        assert len(opt.optimizers[0].state) == 2  # Muon really had the two block matrices


# -- one checkpoint, file by file ------------------------------------------------------------
def _flip(f: Path) -> None:
    data = bytearray(f.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 16] = bytes(b ^ 0xFF for b in data[mid:mid + 16])
    f.write_bytes(bytes(data))


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


DAMAGE = {"flipped": _flip, "truncated": _truncate, "missing": Path.unlink}


def _small_checkpoint(directory: Path, step: int = 3, log=None) -> Path:
    g = torch.Generator().manual_seed(step)
    weights = {"a": torch.randn(64, 8, generator=g), "b": torch.randn(8, generator=g)}
    extra = {"optimizer": {"state": {0: {"step": torch.tensor(3.0), "m": torch.randn(64, 8)}}},
             "rng": {"torch": torch.get_rng_state()}}
    return save_checkpoint(directory, step, weights, extra, {"trained": {"algo": "full"}},
                           ema={k: v * 2 for k, v in weights.items()}, log=log)


def test_a_checkpoint_lists_every_file_in_its_manifest_and_reads_it_back(tmp_path):
    log = {"metrics": [{"step": 1, "loss": 0.5}, {"step": 2, "loss": float("nan")}]}
    path = _small_checkpoint(tmp_path, log=log)
    ck = open_checkpoint(path)
    assert sorted(ck.files()) == sorted(FILES + ["log.json"])
    assert all(e == {"size": (path / n).stat().st_size, "blake2b": hash_file(path / n)}
               for n, e in ck.files().items())
    ck.verify()
    assert ck.step == 3 and ck.trainable().keys() == {"a", "b"}
    assert torch.equal(ck.ema()["a"], 2 * ck.trainable()["a"])
    got = ck.log()
    assert got["metrics"][0] == log["metrics"][0] and math.isnan(got["metrics"][1]["loss"])
    assert _small_checkpoint(tmp_path / "nolog").joinpath("manifest.json").is_file()
    assert open_checkpoint(tmp_path / "nolog" / "step-000003").log() is None


@pytest.mark.parametrize("how", sorted(DAMAGE))
@pytest.mark.parametrize("name", FILES + ["log.json"])
def test_every_read_of_a_damaged_file_raises_an_integrity_error_naming_it(tmp_path, name, how):
    path = _small_checkpoint(tmp_path, log={"metrics": []})
    DAMAGE[how](path / name)
    read = {"trainable.safetensors": lambda c: c.trainable(), "ema.safetensors": lambda c: c.ema(),
            "optimizer.safetensors": lambda c: c.extra(), "optimizer.json": lambda c: c.extra(),
            "log.json": lambda c: c.log(), "state.json": lambda c: c}
    with pytest.raises(IntegrityError, match=f"{name}.*(missing|bytes|hash).*damaged"):
        read[name](open_checkpoint(path))
    with pytest.raises(IntegrityError, match=name):
        Checkpoint(path, 3, {}).verify()
    if name != "state.json":  # the cheap listing does not look at the other files
        assert [c.step for c in list_checkpoints(tmp_path)] == [3]
    # resume: the checkpoint is moved aside; with no other one, None
    assert load_newest(tmp_path, tmp_path / "corrupt") is None
    assert (tmp_path / "corrupt" / "step-000003").is_dir() and not list_checkpoints(tmp_path)


def test_damaged_manifest_or_header(tmp_path):
    path = _small_checkpoint(tmp_path)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(IntegrityError, match="manifest.json is unreadable"):
        open_checkpoint(path)
    (path / "manifest.json").unlink()
    with pytest.raises(IntegrityError, match="manifest.json is missing"):
        open_checkpoint(path)
    # a header whose offsets point past the end is refused before anything is allocated
    path = _small_checkpoint(tmp_path / "b")
    f = path / "trainable.safetensors"
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n].replace(b'"data_offsets":[0,', b'"data_offsets":[9,')
    f.write_bytes(raw[:8] + header + raw[8 + n:])
    with pytest.raises(IntegrityError, match="trainable.safetensors is not a whole safetensors"):
        open_checkpoint(path).trainable()


def test_load_hashes_the_files_it_does_not_read(tmp_path):
    path = _small_checkpoint(tmp_path)
    (path / "future.bin").write_bytes(b"x" * 100)  # a file a later version adds
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["future.bin"] = {"size": 100, "blake2b": hash_file(path / "future.bin")}
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert open_checkpoint(path).load().log is None
    _flip(path / "future.bin")
    with pytest.raises(IntegrityError, match="future.bin does not match"):
        open_checkpoint(path).load()


def test_list_checkpoints_hashes_nothing(tmp_path, monkeypatch):
    for step in (1, 2):
        _small_checkpoint(tmp_path, step)

    def no(*a, **k):
        raise AssertionError("list_checkpoints must not hash or read the big files")

    monkeypatch.setattr(ckpt_mod, "hash_file", no)
    monkeypatch.setattr(ckpt_mod, "_read_safetensors", no)
    assert [c.step for c in list_checkpoints(tmp_path)] == [1, 2]


def test_files_and_folders_get_the_usual_modes(tmp_path):
    old = os.umask(0o022)
    try:
        path = _small_checkpoint(tmp_path / "ck", log={"metrics": []})
        moved = load_newest(tmp_path / "none", tmp_path / "aside")  # nothing to load
        _flip(path / "state.json")
        assert load_newest(tmp_path / "ck", tmp_path / "corrupt") is None
    finally:
        os.umask(old)
    assert moved is None
    aside = tmp_path / "corrupt" / "step-000003"
    for folder in (tmp_path / "ck", aside, tmp_path / "corrupt"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755, folder
    for f in aside.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f
    assert sorted(p.name for p in aside.iterdir()) == sorted(FILES + ["log.json", "manifest.json"])


# -- pickles are never loaded ------------------------------------------------------------------
class _Planted:
    """Unpickling this creates ``marker`` (it could as well run a shell)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def _plant(folder: Path, marker: Path) -> None:
    torch.save({"optimizer": _Planted(marker)}, folder / "optimizer.pt")
    # the planted file is live: an unsafe load would run it
    torch.load(folder / "optimizer.pt", weights_only=False)
    assert marker.exists()
    marker.unlink()


def test_a_planted_pickle_in_a_checkpoint_is_never_loaded(tmp_path, caplog):
    marker = tmp_path / "MARKER"
    path = _small_checkpoint(tmp_path / "ck")
    _plant(path, marker)
    with caplog.at_level(logging.WARNING):
        ck, data = load_newest(tmp_path / "ck", tmp_path / "corrupt")
    assert ck.step == 3 and "ignoring optimizer.pt" in caplog.text
    open_checkpoint(path).verify()
    # the old format: state.json, weights and optimizer.pt only
    for f in ("manifest.json", "optimizer.safetensors", "optimizer.json"):
        (path / f).unlink()
    with pytest.raises(LegacyCheckpointError) as e:
        load_newest(tmp_path / "ck", tmp_path / "corrupt")
    msg = user_message(e.value)
    assert "optimizer.pt" in msg and "can not be loaded safely" in msg and "Re-train" in msg
    assert "kmoss export checkpoint" in msg and path.is_dir()
    with pytest.raises(LegacyCheckpointError):
        open_checkpoint(path).extra()
    legacy = open_checkpoint(path, legacy_weights=True)  # export: the weights, unverified
    assert torch.equal(legacy.trainable()["a"], load_file(str(path / "trainable.safetensors"))["a"])
    assert not marker.exists()


# -- the trainer: fall back to the previous checkpoint, end bit-identical ---------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Data, params and an uninterrupted 6-step run (checkpoints at 2, 4 and 6)."""
    tmp = tmp_path_factory.mktemp("faults")
    ds = make_kohya(tmp / "ds", {"2_a": [(48, 32), (32, 48), (40, 40)], "1_b": [(64, 32)]})
    params = _write_params(tmp, ds, train={"steps": 6, "checkpoint_every": 2, "keep_checkpoints": 5},
                           adapter={"dropout": 0.1}, optim={"ema": 0.9})
    paths = _prepare(tmp, params)
    Trainer(load_params(params), paths).run(progress=False)
    return tmp, params, paths


def _killed_after(reference, name: str, step: int = 4) -> RunPaths:
    """A run killed after ``step``: the reference's checkpoints up to it."""
    tmp, _, paths = reference
    run = RunPaths(paths.plan, paths.catalog, paths.text_cache, paths.latent_cache, tmp / "runs" / name)
    for c in list_checkpoints(paths.checkpoints):
        if c.step <= step:
            shutil.copytree(c.path, run.checkpoints / c.path.name)
    return run


def _assert_same_end(reference, run: RunPaths) -> None:
    """Weights, EMA, optimiser / schedule / RNG states and state.json equal bit for bit (the
    safetensors bytes themselves differ: their metadata is written in hash-map order)."""
    a = open_checkpoint(reference[2].checkpoints / "step-000006")
    b = open_checkpoint(run.checkpoints / "step-000006")
    _same(a.state, b.state)
    for read in (Checkpoint.trainable, Checkpoint.ema, Checkpoint.extra):
        _same(read(a), read(b))


@pytest.mark.parametrize("how", ["flipped", pytest.param("truncated", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", FILES)
def test_a_damaged_newest_checkpoint_is_skipped_and_the_run_ends_bit_identical(reference, caplog,
                                                                             name, how):
    run = _killed_after(reference, f"{name}-{how}")
    DAMAGE[how](run.checkpoints / "step-000004" / name)
    with caplog.at_level(logging.WARNING):
        res = Trainer(load_params(reference[1]), run).run(progress=False)
    assert res.start_step == 2
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
              and "step-000004" in r.getMessage()]
    assert len(warned) == 1 and name in warned[0] and "damaged" in warned[0], caplog.text
    aside = run.run / "corrupt" / "step-000004"
    assert str(aside) in warned[0] and aside.is_dir()
    _assert_same_end(reference, run)


@pytest.mark.parametrize("damage", ["two damaged", pytest.param("no manifest", marks=pytest.mark.slow),
                                    pytest.param("empty folder", marks=pytest.mark.slow)])
def test_other_damage_falls_back_too(reference, caplog, damage):
    run = _killed_after(reference, damage.replace(" ", "-"))
    newest = run.checkpoints / "step-000004"
    if damage == "no manifest":
        (newest / "manifest.json").unlink()
    elif damage == "empty folder":
        shutil.rmtree(newest)
        newest.mkdir()
    else:
        _flip(newest / "trainable.safetensors")
        _truncate(run.checkpoints / "step-000002" / "optimizer.json")
    with caplog.at_level(logging.WARNING):
        res = Trainer(load_params(reference[1]), run).run(progress=False)
    assert res.start_step == (0 if damage == "two damaged" else 2)
    if damage == "two damaged":
        assert "no good checkpoint is left" in caplog.text and "step 0" in caplog.text
        assert sorted(p.name for p in (run.run / "corrupt").iterdir()) == ["step-000002",
                                                                          "step-000004"]
    _assert_same_end(reference, run)


def test_a_planted_pickle_is_ignored_by_resume_and_export(reference, caplog):
    marker = reference[0] / "MARKER-resume"
    run = _killed_after(reference, "planted")
    _plant(run.checkpoints / "step-000004", marker)
    with caplog.at_level(logging.WARNING):
        res = Trainer(load_params(reference[1]), run).run(progress=False)
    assert res.start_step == 4 and "ignoring optimizer.pt" in caplog.text
    _assert_same_end(reference, run)
    load_source(load_params(reference[1]), run.checkpoints / "step-000004")
    assert not marker.exists()


def test_an_old_format_checkpoint_is_refused_never_unpickled(reference):
    marker = reference[0] / "MARKER-old"
    run = _killed_after(reference, "old-format")
    old = run.checkpoints / "step-000004"
    for f in ("manifest.json", "optimizer.safetensors", "optimizer.json"):
        (old / f).unlink()
    _plant(old, marker)
    with pytest.raises(LegacyCheckpointError, match="optimizer.pt is an old-format checkpoint"):
        Trainer(load_params(reference[1]), run).run(progress=False)
    assert old.is_dir() and not (run.checkpoints / "step-000006").exists()
    # its weights can still be exported, as the message says
    src = load_source(load_params(reference[1]), old)
    assert src.step == 4 and src.kind == "adapter"
    assert not marker.exists()


def test_export_of_a_damaged_checkpoint_names_the_file(reference, tmp_path):
    _, params, paths = reference
    p = load_params(params)
    for name, ema in [("trainable.safetensors", False), ("ema.safetensors", True),
                      ("state.json", False), ("manifest.json", False)]:
        ck = tmp_path / name / "step-000006"
        shutil.copytree(paths.checkpoints / "step-000006", ck)
        _flip(ck / name)
        with pytest.raises(IntegrityError, match=name):
            load_source(p, ck, ema=ema)
    # the export reads only what it needs: a damaged optimizer state does not stop it
    ck = tmp_path / "opt" / "step-000006"
    shutil.copytree(paths.checkpoints / "step-000006", ck)
    _flip(ck / "optimizer.safetensors")
    assert load_source(p, ck).step == 6


def test_kmoss_export_of_a_damaged_checkpoint_exits_2_with_one_line(reference, tmp_path):
    from stages.cli import app

    ck = tmp_path / "step-000006"
    shutil.copytree(reference[2].checkpoints / "step-000006", ck)
    _flip(ck / "trainable.safetensors")
    res = CliRunner().invoke(app, ["export", "checkpoint", str(ck), "--params", str(reference[1]),
                                   "--out", str(tmp_path / "x.safetensors")])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1 and "trainable.safetensors" in errors[0], res.output
    assert not (tmp_path / "x.safetensors").exists()
