"""The DVC pipeline and the CLI: a fresh copy of the project runs `dvc repro` end to end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image
from typer.testing import CliRunner

from kohakumoss.cache import build
from kohakumoss.data import planfile, scan
from kohakumoss.export import stage as export_stage
from kohakumoss.training.engines import TUNE_PARAMS
from stages.cli import app

from conftest import ROOT

runner = CliRunner()


def test_help_explains_each_stage():
    for cmd, words in (("scan", "incremental Parquet catalog"), ("plan", "pure function")):
        res = runner.invoke(app, [cmd, "--help"])
        assert res.exit_code == 0 and words in res.output and "--params" in res.output


def test_help_texts_are_paragraphs_the_renderer_wraps_and_there_is_a_version():
    """A docstring's source line breaks do not reach the help (they broke lines mid-sentence):
    every command's help is paragraphs of one line."""
    from stages.cli import reflow

    def commands(group):
        yield from group.registered_commands
        for sub in group.registered_groups:
            yield from commands(sub.typer_instance)

    helps = [c.help for c in commands(app)]
    assert len(helps) >= 12 and all(h and "\n" not in h.replace("\n\n", "") for h in helps), helps
    assert reflow("""One line
    and its rest.

    A second
    paragraph.""") == "One line and its rest.\n\nA second paragraph."
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.startswith("kmoss 0.1.0 (torch ")


def test_tables_are_not_cut_at_80_columns_when_not_a_terminal():
    from stages.common import PIPE_WIDTH, wide_console

    assert wide_console().width == PIPE_WIDTH >= 160  # pytest's stdout is not a terminal


def test_dvc_yaml_declares_what_the_code_reads():
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    assert stages["scan"]["params"] == scan.PARAMS
    assert stages["plan"]["params"] == planfile.PARAMS
    assert stages["cache_text"]["params"] == build.TEXT_PARAMS
    assert stages["cache_latents"]["params"] == build.LATENT_PARAMS
    assert stages["export"]["params"] == export_stage.PARAMS
    assert stages["tune_kernels"]["params"] == TUNE_PARAMS
    # the tuning table sits between the caches and train, and train depends on it
    order = list(stages)
    assert order.index("cache_latents") < order.index("tune_kernels") < order.index("train")
    assert "artifacts/plan" in stages["tune_kernels"]["deps"]
    assert "kohakumoss/kernels" in stages["tune_kernels"]["deps"]
    assert "artifacts/kernels/table.json" in stages["train"]["deps"]
    assert "kernels" in stages["train"]["params"]
    # DVC refuses to run a stage whose declared key is missing from params.yaml
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    for name, body in stages.items():
        for key in body.get("params", []):
            section, _, field = key.partition(".")
            assert section in raw and (not field or field in raw[section]), (name, key)


def test_cli_reports_user_errors_cleanly(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text("data:\n  datasets:\n    - {source: kohya, path: nowhere}\nbatching: {max_tokens: 1}\n")
    res = runner.invoke(app, ["scan", "--params", str(bad)])
    assert res.exit_code == 2
    assert "batching.max_tokens = 1" in res.output and "Traceback" not in res.output


def _git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def project(tmp_path):
    """A fresh clone-like copy of the repository (tracked files only) with git + dvc."""
    dst = tmp_path / "proj"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.splitlines()
    for f in files:
        if (ROOT / f).is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dst / f)
    _git(dst, "init", "-q")
    _git(dst, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    _git(dst, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init")
    return dst


def _dvc(cwd, *args):
    exe = Path(sys.executable).with_name("dvc")
    res = subprocess.run([str(exe), *args], cwd=cwd, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout + res.stderr


def _warmth(png: Path) -> float:
    """Mean red minus blue in 8-bit levels: the demo concept's amber ramp is warm everywhere
    (70 to 165), a blue background cold (-172)."""
    rgb = np.asarray(Image.open(png).convert("RGB"), dtype=np.float64)
    return float((rgb[..., 0] - rgb[..., 2]).mean())


@pytest.mark.slow
def test_dvc_repro_then_override_with_exp_run(project):
    out = _dvc(project, "repro")
    assert "Running stage 'scan'" in out and "Running stage 'plan'" in out
    assert "Running stage 'tune_kernels'" in out  # a CPU table: the reference against compile
    # DVC's log is not a terminal: the long stages print progress lines (count, rate, ETA)
    assert "train: 200/200 step (100%)" in out and "samples/s=" in out and "ETA" in out
    text = _dvc(project, "plots", "show", "--json")
    shown = json.JSONDecoder().raw_decode(text[text.index("{"):])[0]
    images = [k for k in shown["data"] if k.endswith(".png")]
    assert any(k.endswith("step-000200/grid.png") for k in images), list(shown["data"])  # beside the curves
    assert any(k.endswith("step-000000/grid.png") for k in images)  # the untrained model's, to compare
    # the demo visibly learns its trigger (docs/demo.md): the base draws both prompts' blue
    # picture; after 200 steps the prompt with "kohaku" turns amber and the same prompt
    # without it stays far colder (measured: -168 -> +45 against -152 -> -38)
    previews = project / "runs/default/previews"
    (before, trained), (plain_before, plain) = (
        [_warmth(previews / f"step-{step:06d}/p{p}-s0.png") for step in (0, 200)] for p in (0, 1))
    assert before < -100 and plain_before < -100, (before, plain_before)
    assert trained - before > 150, (before, trained)  # the concept appeared for the trigger
    assert trained - plain > 50, (trained, plain)  # and not for the other prompt
    kernels = json.loads((project / "artifacts/kernels/table.json").read_text())["devices"]
    assert [s["signature"]["device"] for s in kernels.values()] == ["cpu"]
    m1 = json.loads((project / "artifacts/plan/manifest.json").read_text())
    assert m1["info"]["batches"] == yaml.safe_load((project / "params.yaml").read_text())["train"]["steps"]
    assert json.loads((project / "artifacts/catalog/manifest.json").read_text())["info"]["datasets"][0]["live"] > 0
    metrics = json.loads((project / "runs/default/dvclive/metrics.json").read_text())
    assert metrics["step"] == m1["info"]["batches"] and metrics["train"]["loss"] > 0
    assert (project / "runs/default/checkpoints" / f"step-{metrics['step']:06d}").is_dir()
    name = f"default-lora-s{metrics['step']}"  # <run.name>-<algo>-s<step>-<format> (docs/exports.md)
    comfy = project / f"runs/default/export/{name}-comfy.safetensors"
    assert comfy.is_file() and (project / f"runs/default/export/{name}-lycoris.safetensors").is_file()
    kmoss = Path(sys.executable).with_name("kmoss")
    check = subprocess.run([str(kmoss), "check", "export", str(comfy), "--source",
                            str(project / "runs/default/checkpoints" / f"step-{metrics['step']:06d}")],
                           cwd=project, capture_output=True, text=True)
    assert check.returncode == 0 and "every key loads" in " ".join(check.stdout.split()), \
        check.stdout + check.stderr
    old = project / "runs/default/checkpoints/step-000150"  # re-export an older step
    again = subprocess.run([str(kmoss), "export", "checkpoint", str(old), "--format", "comfy"],
                           cwd=project, capture_output=True, text=True)
    old_comfy = project / "runs/default/exports/default-lora-s150-comfy.safetensors"
    assert again.returncode == 0 and old_comfy.is_file(), again.stderr
    out = _dvc(project, "repro")  # nothing changed (the re-export is outside every stage's outputs)
    assert "Stage 'plan' didn't change" in out and "Stage 'train' didn't change" in out
    assert "Stage 'tune_kernels' didn't change" in out
    assert "train.loss" in _dvc(project, "metrics", "show")
    # another plan, as an experiment up to the plan stage (the full-length experiment flow,
    # trained and compared beside main, is in tests/faults)
    _dvc(project, "exp", "run", "-S", "run.seed=7", "-S", "resolution.mode=square",
         "-S", "train.steps=20", "plan")
    m2 = json.loads((project / "artifacts/plan/manifest.json").read_text())
    assert m2["content_hash"] != m1["content_hash"]
    summary = json.loads((project / "artifacts/plan/summary.json").read_text())
    assert summary["distinct_sizes"] == 1  # square mode: one size


def test_doctor_reports_missing_weights(tmp_path):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["model"]["transformer"] = str(tmp_path / "no-such-model")
    raw["data"]["datasets"][0]["path"] = str(ROOT / "examples" / "dataset")
    bad = tmp_path / "p.yaml"
    bad.write_text(yaml.safe_dump(raw))
    res = runner.invoke(app, ["doctor", "--params", str(bad)])
    out = " ".join(res.output.split())
    assert res.exit_code == 1 and "torch" in out, out
    assert "model.transformer" in out and "does not exist" in out, out
    assert "fix: kmoss config --weights FOLDER --force" in out, out  # the one command that fixes it
    good = runner.invoke(app, ["doctor", "--params", str(ROOT / "params.yaml"), "--plan",
                               str(tmp_path / "no-plan")])
    assert good.exit_code == 0, good.output
    text = " ".join(good.output.replace("│", " ").split())  # the table's wrapped cells, read on
    assert "memory profile auto: speed is the fastest" in text and "predicted peak" in text
    assert "memory combinations that fit" in text and "kmoss profiles lists them all" in text
    try:  # the optional kernel packages: the version, or what installing one gives
        fa4 = "flash-attn-4 " + metadata.version("flash-attn-4")
    except metadata.PackageNotFoundError:
        fa4 = ("flash-attn-4 not installed (optional: FlashAttention-4's attention on "
               "sm90-sm110: pip install 'kohakumoss[fa4]')")
    assert fa4 in text, text
    # params every stage would refuse: a row of the table, exit 1, no traceback
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["data"]["datasets"][0]["path"] = str(ROOT / "examples" / "dataset")
    adapter, optim = dict(raw["adapter"]), dict(raw["optim"])
    raw["parallel"]["world_size"] = 2
    raw["adapter"], raw["optim"] = {"algo": "full"}, {**optim, "name": "muon"}  # Muon over shards
    bad.write_text(yaml.safe_dump(raw))
    res = runner.invoke(app, ["doctor", "--params", str(bad)])
    out = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 1 and "parallel.world_size = 2" in out and res.exception.__class__ is SystemExit
    raw["profile"], raw["adapter"], raw["optim"] = "auto", adapter, optim
    bad.write_text(yaml.safe_dump(raw))
    res = runner.invoke(app, ["doctor", "--params", str(bad)])
    out = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 0 and "2 ranks on 1 node(s), cpu" in out, out
    assert "for a full 1024-token micro-batch" in text


def test_doctor_names_the_installer_when_a_driver_is_here_but_torch_is_a_cpu_build(tmp_path, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch sees a CUDA device")
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'CUDA Version: 12.8'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    res = runner.invoke(app, ["doctor", "--params", str(ROOT / "params.yaml"), "--plan", str(tmp_path)])
    text = " ".join(res.output.replace("│", " ").split())
    assert "sees no CUDA device" in text and "fix: python scripts/install.py" in text, text


def test_doctor_prints_a_threaded_runs_split(tmp_path):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["parallel"] = {**raw.get("parallel", {}), "mode": "threaded"}
    raw["data"]["datasets"][0]["path"] = str(ROOT / "examples" / "dataset")
    params = tmp_path / "p.yaml"
    params.write_text(yaml.safe_dump(raw))
    res = runner.invoke(app, ["doctor", "--params", str(params), "--plan", str(tmp_path)])
    text = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 0, text
    assert "split cpu: blocks 0-" in text and "+ embedders, text refiner, head, loss" in text, text
    assert "predicted of" in text
