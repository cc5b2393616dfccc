"""kmoss config --wizard: driven in a pseudo-terminal it asks for each choice, writes a params
file that `dvc repro` runs, and offers the memory catalog's fastest rows for the card; it
never asks where stdin is not a terminal."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from kohakumoss.configlib import ConfigError
from kohakumoss.params import load_params
from kohakumoss.setup.wizard import run_wizard
from stages.cli import app

from conftest import ROOT
from test_pipeline import _dvc, project  # noqa: F401


class Terminal:
    """A command on a pseudo-terminal: wait for a prompt, type an answer."""

    def __init__(self, args, cwd):
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(args, cwd=cwd, stdin=slave, stdout=slave, stderr=slave,
                                     env={**os.environ, "COLUMNS": "200", "TERM": "dumb"})
        os.close(slave)
        self.seen = ""

    def expect(self, text: str, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while text not in self.seen:
            assert time.time() < deadline and self.proc.poll() is None or text in self.seen, self.seen
            ready, _, _ = select.select([self.master], [], [], 0.2)
            if ready:
                try:
                    self.seen += os.read(self.master, 4096).decode(errors="replace")
                except OSError:  # the command ended
                    break
        assert text in self.seen, self.seen

    def type(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())

    def finish(self, timeout: float = 300) -> int:
        deadline = time.time() + timeout
        while self.proc.poll() is None and time.time() < deadline:
            ready, _, _ = select.select([self.master], [], [], 0.2)
            if ready:
                try:
                    self.seen += os.read(self.master, 4096).decode(errors="replace")
                except OSError:
                    break
        return self.proc.wait(timeout=10)


@pytest.mark.slow
def test_the_wizard_in_a_terminal_writes_params_that_dvc_repro_runs(project):  # noqa: F811
    kmoss = Path(sys.executable).with_name("kmoss")
    t = Terminal([str(kmoss), "config", "--wizard"], project)
    t.expect("Weights")
    t.type("tiny")
    t.expect("Your images")
    t.type(str(project / "examples" / "dataset"))
    t.expect("run's name")
    t.type("wiz")
    t.expect("Algorithm")
    t.type("lora")
    t.expect("Card")
    t.type("8")
    t.expect("replace it")
    t.type("y")
    t.expect("Use one")
    assert "peak" in t.seen and "the fastest memory settings that fit 8 GiB" in t.seen
    t.type("")  # keep the card's profile
    assert t.finish() == 0, t.seen
    p = load_params(project / "params.yaml")
    assert p.run.name == "wiz" and p.profile == "minimal" and p.data.datasets[0].source == "kohya"
    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["train"]["steps"] = 12  # (the test's time: fewer steps, no previews, no tuning; the rest is the wizard's)
    raw["train"]["checkpoint_every"] = 12
    raw["preview"]["every"] = 0
    raw["kernels"]["table"] = "off"
    (project / "params.yaml").write_text(yaml.safe_dump(raw))
    out = _dvc(project, "repro")
    assert "Running stage 'train'" in out and (project / "runs" / "wiz" / "summary.json").is_file()


def test_a_catalog_row_chosen_becomes_the_manual_profile(tmp_path):
    params = tmp_path / "params.yaml"
    (tmp_path / "recipes").mkdir()
    answers = iter(["tiny", str(ROOT / "examples" / "dataset"), "mine", "lora", "none", "2"])
    said = []
    run_wizard(params, lambda q, d: next(answers), said.append, card=lambda: None)
    p = load_params(params)
    offered = [line for line in said if line.startswith("  2. ")]
    assert offered and p.run.name == "mine"
    assert p.profile == "manual" or p.profile in offered[0]


def test_the_wizard_refuses_an_unknown_algorithm_and_never_asks_without_a_terminal(tmp_path):
    answers = iter(["tiny", str(ROOT / "examples" / "dataset"), "mine", "lorax"])
    with pytest.raises(ConfigError, match="algorithm 'lorax': one of lora"):
        run_wizard(tmp_path / "p.yaml", lambda q, d: next(answers), print, card=lambda: None)
    res = CliRunner().invoke(app, ["config", "--wizard", "--params", str(tmp_path / "p.yaml")])
    assert res.exit_code != 0 and "stdin is not one" in " ".join(res.output.split())
