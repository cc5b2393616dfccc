"""`kmoss check parity` computes what a vector set declares in its config.json (the timestep
distribution's knobs, every stage of a staged table, the inference schedules it lists), not
the package defaults: change a declared knob and the rows it governs fail."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from kohakumoss.checks.parity import run_parity, schedule_comparisons
from kohakumoss.diffusion.timesteps import TECH_REPORT, MossTimesteps
from stages.cli import app

from conftest import ROOT

VECTORS = ROOT / "tests" / "data" / "vectors"


def _copy(tmp: Path) -> Path:
    folder = tmp / "vectors"
    shutil.copytree(VECTORS, folder)
    return folder


def _edit_config(folder: Path, edit) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config["schedules"])
    path.write_text(json.dumps(config))


def _rows(folder: Path, prefix: str) -> dict[str, bool]:
    return {c.name: c.passed for c in schedule_comparisons(folder) if c.name.startswith(prefix)}


def test_the_public_set_passes_as_declared(tmp_path):
    rows = _rows(_copy(tmp_path), "timesteps")
    assert len(rows) == 4 and all(rows.values())


def test_changed_sampler_knobs_make_the_timestep_rows_fail(tmp_path):
    folder = _copy(tmp_path)

    def edit(s):
        s["sampler_knobs"]["mu"] = -0.5
        s["stages"][0]["knobs"]["mu"] = -0.5

    _edit_config(folder, edit)
    rows = _rows(folder, "timesteps")
    assert rows["timesteps stage0 sigma"]  # the sigma grid does not depend on mu
    failed = {name for name, ok in rows.items() if not ok}
    assert failed == {"timesteps stage0 pmf", "timesteps stage0 cdf",
                      "timesteps stage0 draws (seed 0)"}
    # and the command says so with exit status 1
    res = CliRunner().invoke(app, ["check", "parity", str(folder)])
    assert res.exit_code == 1 and "FAIL  timesteps stage0 pmf" in res.output, res.output


def test_an_unknown_declared_knob_fails_instead_of_using_defaults(tmp_path):
    folder = _copy(tmp_path)
    _edit_config(folder, lambda s: s["sampler_knobs"].update(temperature=0.7))
    rows = _rows(folder, "timesteps")
    assert rows and not any(rows.values())
    assert all("temperature" in name for name in rows)


def test_a_listed_inference_schedule_is_checked(tmp_path):
    folder = _copy(tmp_path)
    _edit_config(folder, lambda s: s["inference"]["steps=8 shift=5"]["sigmas"].__setitem__(3, 0.5))
    rows = _rows(folder, "inference")
    assert not rows["inference sigmas steps 8 shift 5 (listed)"]
    assert rows["inference sigmas steps 8 shift 5 (stored)"]
    _edit_config(folder, lambda s: s["inference_default_knobs"].update(training_shift=3.0))
    assert not any(_rows(folder, "inference").values())


def _staged_set(tmp: Path) -> Path:
    """The public set with a staged ("tech_report") table: every stage's tables and draws."""
    folder = _copy(tmp)
    staged = MossTimesteps(schedule=TECH_REPORT)
    tensors = {k: v for k, v in load_file(str(folder / "schedules.safetensors")).items()
               if not k.startswith("sampler.")}
    for n, (start, _) in enumerate(TECH_REPORT):
        pmf, sigma, cdf = staged.tables(start)
        tensors.update({f"sampler.stage{n}.pmf": pmf, f"sampler.stage{n}.sigma": sigma,
                        f"sampler.stage{n}.cdf": cdf,
                        f"sampler.stage{n}.draws_seed0":
                            staged.sample(16, torch.Generator().manual_seed(0), step=start)})
    save_file(tensors, str(folder / "schedules.safetensors"))

    def edit(s):
        s["sampler_knobs"] = {"steps": 1000, "uniform_mix": 0.01, "schedule": "tech_report"}
        s["stages"] = [{"start_step": start, "knobs": {**knobs, "uniform_mix": 0.01}}
                       for start, knobs in TECH_REPORT]

    _edit_config(folder, edit)
    return folder


def test_a_staged_tech_report_set_passes_and_each_stage_is_honoured(tmp_path):
    folder = _staged_set(tmp_path)
    assert all(c.passed for c in run_parity(folder))
    rows = _rows(folder, "timesteps")
    assert len(rows) == 16 and all(rows.values())
    # the stages differ, so computing every stage with stage 0's knobs would fail
    tables = [MossTimesteps(schedule=TECH_REPORT).tables(start)[0] for start, _ in TECH_REPORT]
    assert all(not torch.equal(tables[0], t) for t in tables[1:])
    # declare stage 2 to start after stage 3: stage 2's rows now fail, the others still pass
    _edit_config(folder, lambda s: s["stages"][2].update(start_step=300_000))
    failed = {name.split()[1] for name, ok in _rows(folder, "timesteps").items() if not ok}
    assert failed == {"stage2"}
