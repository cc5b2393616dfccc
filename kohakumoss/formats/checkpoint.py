"""Training checkpoints: written atomically, verified on every read, the newest good one resumed.

A checkpoint is a folder ``step-000050/`` under ``runs/<name>/checkpoints/`` holding

- ``trainable.safetensors``: the adapter state or the full weights, fp32;
- ``ema.safetensors``: the EMA averages (when EMA is on);
- ``optimizer.safetensors`` + ``optimizer.json``: the optimiser, LR-schedule, EMA and RNG
  states as tensors plus the JSON structure that names them (``statefile``): no pickle;
- ``state.json``: step, plan hash, params hash, what was trained; ``log.json``: the run's
  metrics so far (when given);
- ``manifest.json``, written last: every other file's size and blake2b hash.

It is assembled in a ``.tmp-*`` folder, every file fsynced, then renamed into place: a kill
at any moment leaves either the old set of checkpoints or the old set plus one complete
new one. The last ``keep`` checkpoints are kept.

Every read checks what it reads against the manifest (``verified.py``: a safetensors file is
hashed while it is read, once) and raises ``IntegrityError`` naming the file. ``load_newest`` (resume) skips
a newest checkpoint that fails, moves it aside with a warning, and takes the previous one.
A folder with an ``optimizer.pt`` and no manifest is the old, pickled format: it is never
unpickled; resuming from it is refused, and only its weights can be exported (unverified).
Files in a checkpoint that its manifest does not list are ignored.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from kohakumoss import faults
from kohakumoss.artifacts import (ArtifactError, hash_file, public_mode, temp_dir,
                                  write_safetensors)
from kohakumoss.errors import KohakuError
from kohakumoss.formats.verified import Damaged
from kohakumoss.formats.verified import (check_hash as _check_hash, check_size as _check_size,
                                          hash_problem as _hash_problem, parse_json as _parse_json,
                                          read_safetensors as _read_safetensors,
                                          read_small as _read_small, size_problem as _size_problem)
from kohakumoss.formats.statefile import dumps_state, flatten_state, loads_state, unflatten_state

logger = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d{6,})$")
FORMAT, SCHEMA = "kohakumoss-checkpoint", 2
MANIFEST, STATE, LOG = "manifest.json", "state.json", "log.json"
TRAINABLE, EMA_FILE = "trainable.safetensors", "ema.safetensors"
OPT_TENSORS, OPT_TREE = "optimizer.safetensors", "optimizer.json"
LEGACY = "optimizer.pt"  # the old format's pickle: never opened

class LegacyCheckpointError(KohakuError):
    """A checkpoint of the old format (``optimizer.pt``, a pickle), which is never loaded."""


@dataclasses.dataclass
class CheckpointData:
    """What a resume needs, every byte verified."""

    trainable: dict[str, torch.Tensor]
    ema: dict[str, torch.Tensor] | None
    extra: Any
    log: dict[str, Any] | None


@dataclasses.dataclass
class Checkpoint:
    """One checkpoint folder. ``state`` is its state.json (verified when the checkpoint came
    from ``open_checkpoint``; read as is by the cheap ``list_checkpoints``); every method
    verifies the files it reads."""

    path: Path
    step: int
    state: dict[str, Any]
    manifest: dict[str, Any] | None = None  # read on first use
    legacy: bool = False  # old format opened for its weights only

    def files(self) -> dict[str, dict[str, Any]]:
        """The manifest's ``{name: {"size", "blake2b"}}``."""
        if self.manifest is None:
            self.manifest = _read_manifest(self.path)
        return self.manifest["files"]

    def trainable(self) -> dict[str, torch.Tensor]:
        if self.legacy:
            return load_file(str(self.path / TRAINABLE))
        return _read_safetensors(self.path / TRAINABLE, self._entry(TRAINABLE))

    def ema(self) -> dict[str, torch.Tensor] | None:
        if self.legacy:
            f = self.path / EMA_FILE
            return load_file(str(f)) if f.is_file() else None
        if EMA_FILE not in self.files():
            return None
        return _read_safetensors(self.path / EMA_FILE, self._entry(EMA_FILE))

    def extra(self) -> Any:
        """The ``extra`` state given to ``save_checkpoint`` (optimiser, schedule, RNG ...)."""
        tensors = _read_safetensors(self.path / OPT_TENSORS, self._entry(OPT_TENSORS))
        text = _read_small(self.path / OPT_TREE, self._entry(OPT_TREE))
        try:
            return unflatten_state(loads_state(text), tensors)
        except ValueError as e:  # verified bytes that do not decode: a writer's bug
            raise Damaged(self.path, f"{self.path / OPT_TREE} does not decode ({e})") from None

    def log(self) -> dict[str, Any] | None:
        """The metrics log saved with the checkpoint, or None when none was."""
        if LOG not in self.files():
            return None
        return _parse_json(self.path / LOG, _read_small(self.path / LOG, self._entry(LOG)))

    def load(self) -> CheckpointData:
        """Everything in the checkpoint, each file read once and verified; the files that are
        not read (state.json, any this version does not know) are hashed, so a checkpoint
        that loads is whole."""
        data = CheckpointData(self.trainable(), self.ema(), self.extra(), self.log())
        for name in sorted(self.files().keys() - {TRAINABLE, EMA_FILE, OPT_TENSORS, OPT_TREE, LOG}):
            _check_size(self.path / name, self.files()[name])
            _check_hash(self.path / name, hash_file(self.path / name), self.files()[name])
        return data

    def verify(self) -> None:
        """Hash every file the manifest lists; ``IntegrityError`` names each one that is
        missing, of another size, or changed."""
        bad = [problem for name, entry in self.files().items()
               if (problem := _size_problem(self.path / name, entry)
                   or _hash_problem(self.path / name, hash_file(self.path / name), entry))]
        if bad:
            raise Damaged(self.path, "; ".join(bad))

    def _entry(self, name: str) -> dict[str, Any]:
        files = self.files()
        if name not in files:
            raise Damaged(self.path, f"{self.path / name} is not listed in {self.path / MANIFEST}")
        return files[name]


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder with a checkpoint's files (whole or not)."""
    path = Path(path)
    return path.is_dir() and any((path / n).is_file() for n in (MANIFEST, STATE, TRAINABLE, LEGACY))


def open_checkpoint(path: str | os.PathLike, *, legacy_weights: bool = False) -> Checkpoint:
    """The checkpoint in ``path``, its manifest read and its state.json verified (the big
    files are verified as they are read, or all at once by ``verify``).

    An old-format checkpoint raises ``LegacyCheckpointError``; with ``legacy_weights`` (an
    export) it opens for its weights only, unverified, with a warning.
    """
    path = Path(path)
    try:
        manifest = _read_manifest(path)
    except LegacyCheckpointError:
        if not legacy_weights:
            raise
        logger.warning("%s is an old-format checkpoint (no %s): its weights are read without "
                       "verification, and its %s is never opened", path, MANIFEST, LEGACY)
        if not (path / STATE).is_file():
            raise Damaged(path, f"{path / STATE} is missing") from None
        state = _parse_json(path / STATE, (path / STATE).read_bytes())
        return Checkpoint(path, int(state.get("step", 0)), state, legacy=True)
    ckpt = Checkpoint(path, 0, {}, manifest)
    ckpt.state = _parse_json(path / STATE, _read_small(path / STATE, ckpt._entry(STATE)))
    ckpt.step = int(ckpt.state["step"])
    stray = sorted(p.name for p in path.iterdir() if p.name not in manifest["files"]
                   and p.name != MANIFEST)
    if stray:
        logger.warning("%s: ignoring %s, not part of the checkpoint (its manifest does not list "
                       "them)", path, ", ".join(stray))
    return ckpt


def save_checkpoint(directory: str | Path, step: int, trainable: dict[str, torch.Tensor],
                    extra: Any, state: dict[str, Any],
                    ema: dict[str, torch.Tensor] | None = None, keep: int = 3,
                    metadata: dict[str, str] | None = None,
                    log: dict[str, Any] | None = None) -> Path:
    """Write ``step-NNNNNN/`` atomically; ``extra`` is any nested state ``statefile`` takes
    (the optimiser, schedule, EMA counters, RNG), ``log`` the metrics so far."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step-{step:06d}"
    tmp = temp_dir(directory)
    try:
        write_safetensors(_fp32(trainable), tmp / TRAINABLE, metadata or {})
        if ema is not None:
            write_safetensors(_fp32(ema), tmp / EMA_FILE, metadata or {})
        tensors, tree = flatten_state(extra)
        write_safetensors(tensors, tmp / OPT_TENSORS)
        (tmp / OPT_TREE).write_text(dumps_state(tree), encoding="utf-8")
        (tmp / STATE).write_text(json.dumps({**state, "step": step}, indent=2, sort_keys=True))
        if log is not None:
            (tmp / LOG).write_text(json.dumps(log, indent=1), encoding="utf-8")
        files = {f.name: {"size": f.stat().st_size, "blake2b": hash_file(f)}
                 for f in sorted(tmp.iterdir())}
        (tmp / MANIFEST).write_text(json.dumps({"format": FORMAT, "schema": SCHEMA, "step": step,
                                                "files": files}, indent=2, sort_keys=True))
        _fsync_tree(tmp)
        faults.point("checkpoint.write")  # complete, not yet in place
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
    """Checkpoints that look complete, oldest first: a ``step-N`` folder with a readable
    state.json (temp folders of killed writes are ignored). Cheap: nothing is hashed; a
    checkpoint's methods verify what they read."""
    out = []
    for d in _step_dirs(Path(directory)):
        try:
            state = json.loads((d / STATE).read_text())
        except (OSError, ValueError):
            continue
        out.append(Checkpoint(d, int(STEP_DIR.match(d.name).group(1)), state))
    return out


def load_newest(directory: str | Path, aside: str | Path | None
                ) -> tuple[Checkpoint, CheckpointData] | None:
    """The newest checkpoint of ``directory`` that reads back whole, and its contents.

    Each newer one that fails verification (a missing, truncated or changed file, no
    manifest, an unreadable state.json) is moved to ``aside/`` with a warning naming it and
    why; None (with a warning) when no good one is left. With ``aside`` None (a rank other
    than 0, which reads what rank 0 left and judges nothing) the newest one is read as it is
    and a damaged one raises. An old-format checkpoint raises ``LegacyCheckpointError``.
    """
    directory = Path(directory)
    skipped = 0
    for d in reversed(_step_dirs(directory)):
        if aside is None:
            ckpt = open_checkpoint(d)
            return ckpt, ckpt.load()
        try:
            ckpt = open_checkpoint(d)
            return ckpt, ckpt.load()
        except Damaged as e:
            dest = _move_aside(d, Path(aside))
            skipped += 1
            logger.warning("checkpoint %s is damaged (%s) and is skipped: moved to %s, outside the "
                           "DVC-tracked checkpoints folder (inspect it, then delete it); trying the "
                           "previous checkpoint", d.name, e.problem, dest)
    if skipped:
        logger.warning("no good checkpoint is left in %s; training starts from step 0", directory)
    return None


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


# -- reading, verified ----------------------------------------------------------------------
def _legacy(folder: Path) -> str:
    return (f"{folder / LEGACY} is an old-format checkpoint (a pickle), which can not be loaded "
            f"safely, so it is not read. Re-train from the last step: move {folder.parent} aside "
            f"and run again (training starts from step 0), or export its weights with `kmoss "
            f"export checkpoint {folder}`")


def _read_manifest(folder: Path) -> dict[str, Any]:
    f = folder / MANIFEST
    if not f.is_file():
        if (folder / LEGACY).is_file():
            raise LegacyCheckpointError(_legacy(folder))
        raise Damaged(folder, f"{f} is missing (the checkpoint was not written by this version "
                              f"or was damaged)")
    try:
        m = json.loads(f.read_bytes())
        ok = m["format"] == FORMAT and isinstance(m["files"], dict) and all(
            Path(n).name == n and n not in ("", ".", "..", MANIFEST) and type(e["size"]) is int
            and isinstance(e["blake2b"], str) for n, e in m["files"].items())
    except (ValueError, KeyError, TypeError) as e:
        raise Damaged(folder, f"{f} is unreadable ({e})") from None
    if not ok:
        raise Damaged(folder, f"{f} is not a checkpoint manifest")
    return m


# -- writing -------------------------------------------------------------------------------
def _fp32(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().contiguous().cpu() for k, v in tensors.items()}


def _fsync_tree(path: Path) -> None:
    """fsync every file of ``path`` and give it the usual mode (safetensors writes 0600)."""
    for f in path.iterdir():
        public_mode(f)
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def _step_dirs(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    found = [d for d in directory.iterdir() if STEP_DIR.match(d.name) and d.is_dir()]
    return sorted(found, key=lambda d: int(STEP_DIR.match(d.name).group(1)))


def _move_aside(folder: Path, aside: Path) -> Path:
    aside.mkdir(parents=True, exist_ok=True)
    dest, n = aside / folder.name, 1
    while dest.exists():
        dest, n = aside / f"{folder.name}-{n}", n + 1
    shutil.move(str(folder), str(dest))
    return dest
