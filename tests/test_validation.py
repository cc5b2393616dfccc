"""The validation loss (``validation:``, ``kohakumoss/training/validation.py``): held-out
images the plan records and never trains on, evaluated at fixed noise levels with noise that
is a pure function of the seed and the image."""

from __future__ import annotations

import shutil

import pyarrow.parquet as pq
import pytest

from kohakumoss.formats import checkpoint as ckpt_mod
from kohakumoss.params import load_params
from kohakumoss.training.build import RunPaths
from kohakumoss.training.trainer import Trainer

from conftest import make_kohya
from test_train import _prepare, _write_params

IMAGES = {"2_a": [(48, 32), (32, 48), (40, 40), (32, 32)], "1_b": [(64, 32), (32, 64), (48, 48)]}


@pytest.fixture
def held(tmp_path):
    """A dataset and a second one held out whole for validation."""
    ds = make_kohya(tmp_path / "ds", IMAGES)
    val = make_kohya(tmp_path / "val", {"1_c": [(40, 32), (32, 40), (48, 32)]})
    return tmp_path, ds, val


def _params(tmp, ds, val, **over):
    path = _write_params(tmp, ds, **over)
    import yaml

    raw = yaml.safe_load(path.read_text())
    raw["data"]["datasets"].append({"source": "kohya", "path": str(val), "validation": True})
    path.write_text(yaml.safe_dump(raw))
    return path


def _rows(checkpoint):
    return ckpt_mod.open_checkpoint(checkpoint).log()["metrics"]


def test_the_plan_holds_out_what_validation_evaluates(tmp_path):
    """``validation.share`` holds out images by their identity: none of them is trained on,
    the same ones are held out for another seed, and the held-out file has each once."""
    ds = make_kohya(tmp_path / "ds", IMAGES)
    seen = []
    for seed in (0, 1):
        params = _write_params(tmp_path, ds, validation={"share": 0.4}, run={"seed": seed},
                               train={"steps": 6})
        paths = _prepare(tmp_path, params)
        train = pq.read_table(paths.plan / "plan.parquet").column("uid").to_pylist()
        val = pq.read_table(paths.plan / "validation.parquet")
        uids = val.column("uid").to_pylist()
        assert uids and len(set(uids)) == len(uids) and not set(uids) & set(train)
        assert not any(val.column("flip").to_pylist()) and set(val.column("variant").to_pylist()) == {0}
        assert not any(val.column("text_drop").to_pylist())
        seen.append(sorted(uids))
    assert seen[0] == seen[1]


def test_a_held_out_dataset_is_never_trained_on_and_changes_no_training(held):
    """A dataset entry with ``validation: true``: its images are evaluated, never trained on;
    evaluating changes neither the losses nor the weights."""
    tmp, ds, val = held
    base = dict(train={"steps": 4, "checkpoint_every": 4})
    params = _params(tmp, ds, val, **base)
    paths = _prepare(tmp, params)
    train = pq.read_table(paths.plan / "plan.parquet").column("dataset").to_pylist()
    held_out = pq.read_table(paths.plan / "validation.parquet").column("dataset").to_pylist()
    assert set(train) == {0} and held_out == [1, 1, 1]
    plain = Trainer(load_params(params), paths).run(progress=False)
    shown = _params(tmp, ds, val, **base, validation={"every": 2})
    other = RunPaths(paths.plan, paths.catalog, paths.text_cache, paths.latent_cache, tmp / "runs" / "v")
    evaluated = Trainer(load_params(shown), other).run(progress=False)
    assert evaluated.losses == plain.losses
    rows = _rows(other.checkpoints / "step-000004")
    steps = [r["step"] for r in rows if "val/loss" in r]
    assert steps == [0, 2, 4]
    r = next(r for r in rows if "val/loss" in r)
    assert {k for k in r if k.startswith("val/")} == {"val/loss", *(f"val/loss_s{s:.2f}" for s in
                                                                    (0.1, 0.3, 0.5, 0.7, 0.9))}
    bands = [r[f"val/loss_s{s:.2f}"] for s in (0.1, 0.3, 0.5, 0.7, 0.9)]
    assert r["val/loss"] == pytest.approx(sum(bands) / 5)


def test_the_validation_loss_of_a_resumed_run_equals_the_uninterrupted_runs(held):
    tmp, ds, val = held
    params = _params(tmp, ds, val, train={"steps": 4, "checkpoint_every": 2},
                     adapter={"algo": "lora", "dim": 4, "alpha": 4, "dropout": 0.1},
                     validation={"every": 1})
    paths = _prepare(tmp, params)
    Trainer(load_params(params), paths).run(progress=False)
    resumed = RunPaths(paths.plan, paths.catalog, paths.text_cache, paths.latent_cache, tmp / "runs" / "b")
    shutil.copytree(paths.checkpoints / "step-000002", resumed.checkpoints / "step-000002")
    assert Trainer(load_params(params), resumed).run(progress=False).start_step == 2

    def held_rows(run):
        return [{k: v for k, v in r.items() if k == "step" or k.startswith("val/")}
                for r in _rows(run.checkpoints / "step-000004") if "val/loss" in r]

    want = held_rows(paths)
    assert [r["step"] for r in want] == [0, 1, 2, 3, 4]
    assert held_rows(resumed) == want  # bit for bit, every evaluation


def test_the_validation_loss_falls_as_it_learns_and_is_flat_at_learning_rate_zero(held):
    tmp, ds, val = held
    curves = {}
    for lr in (0.0, 1e-2):
        params = _params(tmp, ds, val, train={"steps": 12, "checkpoint_every": 12},
                         optim={"lr": lr}, validation={"every": 4}, run={"name": f"lr{int(lr * 1000)}"})
        paths = _prepare(tmp, params)
        run = RunPaths(paths.plan, paths.catalog, paths.text_cache, paths.latent_cache, tmp / "runs" / f"lr{int(lr * 1000)}")
        Trainer(load_params(params), run).run(progress=False)
        curves[lr] = [r["val/loss"] for r in _rows(run.checkpoints / "step-000012") if "val/loss" in r]
    flat, learning = curves[0.0], curves[1e-2]
    assert len(flat) == 4 and len(set(flat)) == 1
    assert learning[0] == flat[0] and learning[-1] < learning[0]


def test_a_t_lora_run_validates_at_full_rank_between_its_steps(held, monkeypatch):
    """T-LoRA ranks follow each training batch's timesteps; a validation pass between steps
    runs at full rank (no training batch's masks installed) and training resumes exactly as
    without it."""
    from kohakumoss.training import validation as val_mod

    masked = []
    real = val_mod.Validator._loss

    def spy(self, *args, **kwargs):
        masked.append(bool(self.trainer.trainable.adapters.masks))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(val_mod.Validator, "_loss", spy)
    tmp, ds, val = held
    base = dict(train={"steps": 3, "checkpoint_every": 3}, adapter={"algo": "tlora", "dim": 4, "alpha": 4})
    params = _params(tmp, ds, val, **base)
    paths = _prepare(tmp, params)
    plain = Trainer(load_params(params), paths).run(progress=False)
    shown = _params(tmp, ds, val, **base, validation={"every": 1})
    other = RunPaths(paths.plan, paths.catalog, paths.text_cache, paths.latent_cache, tmp / "runs" / "t")
    assert Trainer(load_params(shown), other).run(progress=False).losses == plain.losses
    assert [r["step"] for r in _rows(other.checkpoints / "step-000003") if "val/loss" in r] == [0, 1, 2, 3]
    assert masked and not any(masked)
