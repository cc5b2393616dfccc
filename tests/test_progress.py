"""Progress: a bar in a terminal, one line per interval otherwise, with rate, ETA and values."""

from __future__ import annotations

import io

import pytest
from tqdm.auto import tqdm

from kohakumoss.progress import LineProgress, progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar_and_a_pipe_gets_lines():
    assert isinstance(progress(3, "x", "it", stream=_Terminal()), tqdm)
    assert isinstance(progress(3, "x", "it", stream=io.StringIO()), LineProgress)
    off = progress(3, "x", "it", enabled=False, stream=io.StringIO())
    assert isinstance(off, tqdm) and off.disable


def test_lines_carry_the_count_rate_eta_and_values():
    out = io.StringIO()
    with progress(4, "train", "step", stream=out, interval=0) as bar:
        for i in range(4):
            bar.set_postfix({"loss": f"{1 / (i + 1):.3f}", "samples/s": "12.0"})
            bar.update(1)
    lines = out.getvalue().splitlines()
    assert len(lines) == 4  # one per update at interval 0; close adds nothing new
    assert lines[0].startswith("train: 1/4 step (25%)") and "step/s" in lines[0] and "ETA" in lines[0]
    assert "loss=1.000" in lines[0] and "samples/s=12.0" in lines[0]
    assert lines[-1].startswith("train: 4/4 step (100%)") and "ETA" not in lines[-1]


def test_a_long_interval_prints_the_first_and_last_lines_only(monkeypatch):
    monkeypatch.setenv("KMOSS_PROGRESS_SECONDS", "3600")
    out = io.StringIO()
    bar = progress(100, "cache_latents", "image", stream=out, initial=10)
    for _ in range(90):
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert [ln.split(" (")[0] for ln in lines] == ["cache_latents: 11/100 image", "cache_latents: 100/100 image"]
    out = io.StringIO()
    bar = progress(None, "scan", "item", stream=out)  # no total: counts, no percentage or ETA
    bar.update(5)
    bar.close()
    assert out.getvalue().startswith("scan: 5 item,") and "ETA" not in out.getvalue()


@pytest.mark.parametrize("seconds", ["0"])
def test_training_prints_progress_lines_when_stderr_is_not_a_terminal(tmp_path, capfd, monkeypatch, seconds):
    """What DVC's log shows of `kmoss train`: lines with the step, loss, samples/s and ETA."""
    import shutil

    from conftest import make_kohya
    from test_train import _prepare, _write_params

    from kohakumoss.params import load_params
    from kohakumoss.training.build import build_components
    from kohakumoss.training.trainer import Trainer

    monkeypatch.setenv("KMOSS_PROGRESS_SECONDS", seconds)
    ds = make_kohya(tmp_path / "ds", {"1_a": [(48, 32), (32, 48)]})
    params = _write_params(tmp_path, ds, train={"steps": 3, "checkpoint_every": 3})
    p, paths = load_params(params), _prepare(tmp_path, params)
    capfd.readouterr()
    Trainer(p, paths, build_components(p, paths)).run(progress=True)
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("train: ")]
    assert [ln.split(" (")[0] for ln in lines] == ["train: 1/3 step", "train: 2/3 step", "train: 3/3 step"]
    assert all("loss=" in ln and "samples/s=" in ln for ln in lines) and "ETA" in lines[0]
    shutil.rmtree(tmp_path / "ds")
