"""Training checkpoints: written atomically, the newest complete one resumed from.

A checkpoint is a directory ``step-000050/`` under ``runs/<name>/checkpoints/`` holding
``trainable.safetensors`` (adapter state or full weights, fp32), ``ema.safetensors`` (when
EMA is on), ``optimizer.pt`` (optimizer, LR schedule, EMA and RNG states) and
``state.json`` (step, plan hash, params hash, what was trained). It is assembled in a
``.tmp-*`` directory, every file fsynced, then renamed into place: a kill at any moment
leaves either the old set of checkpoints or the old set plus one complete new one. The
last ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kohakumoss.artifacts import ArtifactError

STEP_DIR = re.compile(r"^step-(\d{6,})$")


@dataclasses.dataclass
class Checkpoint:
    path: Path
    step: int
    state: dict[str, Any]

    def trainable(self) -> dict[str, torch.Tensor]:
        return load_file(str(self.path / "trainable.safetensors"))

    def ema(self) -> dict[str, torch.Tensor] | None:
        f = self.path / "ema.safetensors"
        return load_file(str(f)) if f.is_file() else None

    def extra(self) -> dict[str, Any]:
        return torch.load(self.path / "optimizer.pt", map_location="cpu", weights_only=False)


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def save_checkpoint(directory: str | Path, step: int, trainable: dict[str, torch.Tensor],
                    extra: dict[str, Any], state: dict[str, Any],
                    ema: dict[str, torch.Tensor] | None = None, keep: int = 3,
                    metadata: dict[str, str] | None = None) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step-{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=directory))
    try:
        tensors = {k: v.detach().float().contiguous().cpu() for k, v in trainable.items()}
        save_file(tensors, str(tmp / "trainable.safetensors"), metadata=metadata or {})
        if ema is not None:
            save_file({k: v.detach().float().contiguous().cpu() for k, v in ema.items()},
                      str(tmp / "ema.safetensors"), metadata=metadata or {})
        torch.save(extra, tmp / "optimizer.pt")
        (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=2, sort_keys=True))
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    for old in list_checkpoints(directory)[:-keep]:
        shutil.rmtree(old.path)
    return final


def list_checkpoints(directory: str | Path) -> list[Checkpoint]:
    """Complete checkpoints, oldest first (temp directories of killed writes are ignored)."""
    directory = Path(directory)
    out = []
    if not directory.is_dir():
        return out
    for d in directory.iterdir():
        m = STEP_DIR.match(d.name)
        if not (m and d.is_dir() and (d / "state.json").is_file()):
            continue
        try:
            state = json.loads((d / "state.json").read_text())
        except json.JSONDecodeError:
            continue
        out.append(Checkpoint(d, int(m.group(1)), state))
    return sorted(out, key=lambda c: c.step)


def clean_partial(directory: str | Path) -> None:
    """Remove temp directories a killed write left behind."""
    for d in Path(directory).glob(".tmp-*"):
        shutil.rmtree(d, ignore_errors=True)


def check_resumable(ckpt: Checkpoint, expected: dict[str, Any]) -> None:
    """Refuse a checkpoint made against another plan or another trained thing."""
    diffs = [f"{k}: checkpoint {ckpt.state.get(k)!r}, this run {v!r}" for k, v in expected.items()
             if ckpt.state.get(k) != v]
    if diffs:
        raise ArtifactError(f"checkpoint {ckpt.path} cannot be resumed by this run ("
                            + "; ".join(diffs) + "). Move the old run aside (or change run.name) "
                            "to start fresh, or restore the params it was made with")


def archive_checkpoints(directory: str | Path, history: str | Path, label: str) -> Path:
    """Move every checkpoint of ``directory`` to ``history/label`` (a finished earlier run)."""
    target = Path(history) / label
    target.mkdir(parents=True, exist_ok=True)
    for c in list_checkpoints(directory):
        dest = target / c.path.name
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(c.path, dest)
    return target
