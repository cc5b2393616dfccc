"""scripts/install.py: the torch index of the driver's CUDA version, read from nvidia-smi
(a fake one on PATH here), and the project's extras for the cards; --dry-run runs nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPT = ROOT / "scripts" / "install.py"
HEADER = """+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 570.86.15              Driver Version: 570.86.15      CUDA Version: {cuda}     |
|-----------------------------------------+------------------------+----------------------+
"""


def _fake_smi(tmp_path, cuda: str | None, caps: list[str]):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if cuda is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/bin/sh\nif [ \"$1\" = \"--query-gpu=compute_cap\" ]; then\n"
                       + "".join(f"echo {c}\n" for c in caps) + "else\ncat <<'EOF'\n"
                       + HEADER.format(cuda=cuda) + "EOF\nfi\n")
        smi.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin"}


@pytest.mark.parametrize("cuda, caps, index, project", [
    ("12.6", ["8.6"], "cu126", "."),
    ("12.8", ["8.9", "8.9"], "cu128", "."),
    ("12.9", ["9.0"], "cu128", ".[fa4]"),
    ("13.0", ["12.0"], "cu130", ".[fa4]"),
    (None, [], "cpu", "."),
])
def test_the_index_follows_the_driver_and_the_extras_the_cards(tmp_path, cuda, caps, index, project):
    env = _fake_smi(tmp_path, cuda, caps)
    res = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = [line[2:] for line in res.stdout.splitlines() if line.startswith("+ ")]
    assert lines[0].endswith(f"-m pip install 'torch>=2.11' --index-url https://download.pytorch.org/whl/{index}")
    assert lines[1].endswith(f"-m pip install -e {project if project == '.' else repr(project)}")
    assert lines[2] == "kmoss doctor"
    assert ("CPU build" in res.stdout) == (cuda is None)


def test_an_old_driver_is_refused_with_the_fix(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], env=_fake_smi(tmp_path, "12.2", ["8.6"]),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "supports CUDA 12.2" in res.stderr and "update the driver" in res.stderr


def test_cpu_and_eightbit_flags(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--cpu", "--eightbit"],
                         env=_fake_smi(tmp_path, "13.0", ["9.0"]), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "whl/cpu" in res.stdout and "'.[eightbit]'" in res.stdout


def test_the_shell_script_runs_the_installer(tmp_path):
    res = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), "--dry-run"],
                         env={**_fake_smi(tmp_path, "12.8", ["9.0"]), "PYTHON": sys.executable},
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "whl/cu128" in res.stdout and "'.[fa4]'" in res.stdout
