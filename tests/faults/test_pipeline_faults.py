"""The pipeline under DVC and faults: kill -9 inside every writing stage, a forced re-run of a
finished run, a full disk, experiments; afterwards `dvc repro` succeeds and every output
equals an uninterrupted run's (metric rows included, timing columns aside).

One uninterrupted reference project is built per module; each scenario works on a copy of
it (git + DVC cache included), removes the outputs of the stage under test, and runs
`dvc repro` with ``KMOSS_KILL_AT`` naming the point where the stage SIGKILLs itself
(``kohakumoss/faults.py``), then `dvc repro` again without it.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from kohakumoss.artifacts import hash_file
from kohakumoss.training.metrics import TIMING, comparable

from conftest import ROOT

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
RUN = Path("runs/default")
# a short run with every kind of output: 12 steps, checkpoints every 4 (3 kept), a preview
FAST = {"train": {"steps": 12, "checkpoint_every": 4, "keep_checkpoints": 3},
        "preview": {"every": 6, "steps": 2},
        # the reference kernels: a CPU table would have these 12-step runs spend most of
        # their time compiling (the table's own faults: tests/test_tuning.py; a tuned run
        # end to end: tests/test_pipeline.py)
        "kernels": {"table": "off"}}


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=cwd,
                   check=True, capture_output=True)


def _run(cmd: list[str], cwd: Path, kill_at: str | None, preexec) -> subprocess.CompletedProcess:
    """Run ``cmd`` with its output in files, not pipes: a killed stage's orphans (if any)
    could hold a pipe open and hang the test; a file cannot."""
    env = {k: v for k, v in os.environ.items() if k != "KMOSS_KILL_AT"}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    if kill_at:
        env["KMOSS_KILL_AT"] = kill_at
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        code = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=err, text=True,
                              preexec_fn=preexec, timeout=1200).returncode
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, code, out.read(), err.read())


def dvc(cwd: Path, *args: str, kill_at: str | None = None, ok: bool = True,
        preexec=None) -> subprocess.CompletedProcess:
    res = _run([str(BIN / "dvc"), *args], cwd, kill_at, preexec)
    if ok:
        assert res.returncode == 0, res.stdout + res.stderr
    return res


def kmoss(cwd: Path, *args: str, preexec=None) -> subprocess.CompletedProcess:
    return _run([str(BIN / "kmoss"), *args], cwd, None, preexec)


def make_project(dst: Path, data: Path) -> Path:
    """A fresh clone of the repository whose dataset is ``data``: an absolute path every
    copy shares, since catalogs (and so every downstream key) record where images live."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.splitlines()
    for f in files:
        if (ROOT / f).is_file() and f != "dvc.lock":
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dst / f)
    raw = yaml.safe_load((dst / "params.yaml").read_text())
    for section, values in FAST.items():
        raw[section].update(values)
    raw["data"]["datasets"][0]["path"] = str(data)
    # the faults are under test, not the demo: the tiny components built in code load fastest
    raw["model"].update(transformer="tiny", text_encoder="tiny", vae="tiny")
    raw["caption"]["tokenizer"] = "tiny"
    (dst / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    _git(dst, "init", "-q")
    _git(dst, "add", "-A")
    _git(dst, "commit", "-qm", "init")
    return dst


def outputs(project: Path) -> dict[str, object]:
    """Everything the pipeline leaves, in a form two equal runs share exactly."""
    out: dict[str, object] = {}
    for name in ("artifacts/catalog/manifest.json", "artifacts/plan/manifest.json",
                 "artifacts/cache/text/manifest.json", "artifacts/cache/latents/manifest.json",
                 RUN / "summary.json"):
        out[str(name)] = (project / name).read_text()
    metrics = json.loads((project / RUN / "dvclive/metrics.json").read_text())
    out["metrics.json"] = {**metrics, "train": {k: v for k, v in metrics["train"].items()
                                                if k not in TIMING}}
    plots = project / RUN / "dvclive/plots/metrics/train"
    for tsv in sorted(plots.glob("*.tsv")):
        rows = tsv.read_text().splitlines()
        # timing columns: the same steps, not the same values
        out[f"plot {tsv.name}"] = ([r.split("\t")[0] for r in rows] if tsv.stem in TIMING else rows)
    for ckpt in sorted((project / RUN / "checkpoints").iterdir()):
        for f in sorted(ckpt.iterdir()):
            if f.name == "log.json":
                out[f"{ckpt.name}/log"] = comparable(json.loads(f.read_text())["metrics"])
            elif f.name != "manifest.json":  # the manifest hashes log.json's timing columns too
                out[f"{ckpt.name}/{f.name}"] = hash_file(f)
    for f in sorted((project / RUN / "export").iterdir()):
        out[f"export/{f.name}"] = hash_file(f)
    for f in sorted((project / RUN / "previews").rglob("*.png")):
        out[f"previews/{f.relative_to(project / RUN / 'previews')}"] = hash_file(f)
    return out


def no_temp_files(project: Path) -> list[Path]:
    return [p for top in ("artifacts", "runs") for p in (project / top).rglob("*")
            if p.name.endswith(".tmp") or p.name.startswith(".tmp-")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict[str, object]]:
    data = tmp_path_factory.mktemp("data") / "dataset"
    shutil.copytree(ROOT / "examples" / "dataset", data)
    project = make_project(tmp_path_factory.mktemp("ref") / "proj", data)
    dvc(project, "repro")
    _git(project, "add", "-A")
    _git(project, "commit", "-qm", "main run")
    return project, outputs(project)


@pytest.fixture
def copy(reference, tmp_path) -> Path:
    dst = tmp_path / "proj"
    shutil.copytree(reference[0], dst, symlinks=True)
    return dst


STAGE_OUTPUTS = {
    "cache_text": ["artifacts/cache/text"],
    "cache_latents": ["artifacts/cache/latents"],
    "train": [str(RUN)],
    "export": [str(RUN / "export")],
}
KILLS = [
    ("cache_text", "cache.fill"), ("cache_text", "cache.shard"), ("cache_text", "cache.manifest"),
    ("cache_latents", "cache.fill"), ("cache_latents", "cache.shard"),
    ("cache_latents", "cache.manifest"),
    ("train", "train.start"), ("train", "checkpoint.write:2"), ("train", "train.finish"),
    ("export", "export.write"), ("export", "export.write:2"), ("export", "export.manifest"),
]


@pytest.mark.parametrize("stage,point", KILLS, ids=[f"{s}-{p}" for s, p in KILLS])
def test_kill_then_repro_equals_uninterrupted(reference, copy, stage, point):
    if stage == "export":  # not persisted: DVC would restore it from its cache, so force it
        target = ["-f", "-s", "export"]
    else:  # persisted outputs: remove them so the stage has its work to do again
        target = []
        for out in STAGE_OUTPUTS[stage]:
            shutil.rmtree(copy / out)
    # --no-run-cache: the stage itself must recover, not DVC's run cache
    killed = dvc(copy, "repro", "--no-run-cache", *target, kill_at=point, ok=False)
    assert killed.returncode != 0, f"{point} was never reached:\n{killed.stdout}{killed.stderr}"
    assert f"Running stage '{stage}'" in killed.stdout
    dvc(copy, "repro", "--no-run-cache")
    assert outputs(copy) == reference[1]
    assert no_temp_files(copy) == []
    status = dvc(copy, "status").stdout  # and the pipeline is settled: only the scan is due
    assert status.split() == ["scan:", "always", "changed"], status


def test_forced_rerun_of_a_finished_train_stage(reference, copy):
    forced = dvc(copy, "repro", "-f", "train")
    assert "the run is complete at step 12" in forced.stdout + forced.stderr
    assert outputs(copy) == reference[1]
    after = dvc(copy, "repro")
    assert "Running stage 'train'" not in after.stdout
    assert outputs(copy) == reference[1]
    # the README's re-export of an older step does not touch any DVC-tracked output
    res = kmoss(copy, "export", "checkpoint", str(RUN / "checkpoints/step-000008"))
    assert res.returncode == 0, res.stderr
    status = dvc(copy, "status").stdout  # the scan is always_changed; nothing else may be
    assert status.split() == ["scan:", "always", "changed"], status


def test_experiment_metrics_show_beside_main(reference, copy):
    dvc(copy, "exp", "run", "-S", "optim.lr=0.001")
    table = json.loads(dvc(copy, "exp", "show", "--json").stdout)

    def loss(rev):
        metrics = (rev["data"].get("metrics") or {}).get(f"{RUN}/dvclive/metrics.json") or {}
        return metrics.get("data", {}).get("train", {}).get("loss")

    baseline = [row for row in table if row["rev"] != "workspace"]
    assert len(baseline) == 1  # the commit of the main run (its dvc.lock names cached metrics)
    experiments = [rev for e in (baseline[0].get("experiments") or []) for rev in e["revs"]]
    main = json.loads((reference[0] / RUN / "dvclive/metrics.json").read_text())["train"]["loss"]
    assert loss(baseline[0]) == main
    assert len(experiments) == 1 and loss(experiments[0]) not in (None, main)


def _limit_file_size(limit: int):
    def set_limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return set_limit


@pytest.mark.parametrize("stage", ["cache_text", "train"])
def test_full_disk_is_one_clear_line_and_nothing_trusted(reference, copy, stage):
    for out in STAGE_OUTPUTS[stage]:
        shutil.rmtree(copy / out)
    # small files still fit; the first shard / checkpoint file does not
    full = kmoss(copy, stage, preexec=_limit_file_size({"cache_text": 2048, "train": 65536}[stage]))
    assert full.returncode == 2, full.stdout + full.stderr
    assert "Traceback" not in full.stderr
    errors = [line for line in full.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "disk space or over the file-size limit" in errors[0]
    assert no_temp_files(copy) == []
    dvc(copy, "repro")
    assert outputs(copy) == reference[1]
