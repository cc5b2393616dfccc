"""The export stage: the run's newest (or chosen) checkpoint in the configured formats, and
where exports go and what they are called (``export_name``, ``default_output``).

Names carry the run, the experiment, the algorithm and the step, so the files of different
runs and experiments can sit side by side in ComfyUI's ``models/loras``:
``<run.name>[-<experiment>]-<algo>-s<step>-<format>.safetensors`` (a diffusers folder has no
suffix). The experiment is ``DVC_EXP_NAME``, which ``dvc exp run`` sets for every stage it
runs; a plain ``dvc repro`` or ``kmoss export`` has none.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from kohakumoss import faults
from kohakumoss.artifacts import (ArtifactError, code_version, dir_lock, hash_json, make_manifest,
                                  read_manifest, write_manifest)
from kohakumoss.config import Params, stage_params
from kohakumoss.export.formats import ExportError, Source, load_source, write_export
from kohakumoss.formats.checkpoint import list_checkpoints, open_checkpoint
from kohakumoss.formats.trained import TrainedError, trained_config

log = logging.getLogger(__name__)

PARAMS = ["run.name", "run.seed", "model.transformer", "export"]
TRAINING_KEYS = ["adapter", "optim", "objective", "train"]
ADAPTER_DEFAULT = ("comfy", "lycoris")
FULL_DEFAULT = ("merged",)
EXPERIMENT_ENV = "DVC_EXP_NAME"  # dvc/repo/experiments/queue/base.py puts it in run_env
RUN_FOLDERS = ("checkpoints", "history", "export")  # what a run folder holds (runs/<name>/...)


def _part(text: str) -> str:
    """``text`` fit for a file name: anything but letters, digits, ``.``, ``_``, ``+`` and
    ``-`` becomes ``_``."""
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", text).strip("._")


def _suffix(fmt: str) -> str:
    return "" if fmt == "diffusers" else ".safetensors"


def export_name(run: str, src: Source, fmt: str, experiment: str = "") -> str:
    """``<run>[-<experiment>]-<algo>-s<step>-<fmt>.safetensors`` for a checkpoint source."""
    step = f"s{src.step}" if src.step is not None else ""
    parts = (run, experiment, str(src.describe.get("algo", "")), step, fmt)
    return "-".join(p for p in map(_part, parts) if p) + _suffix(fmt)


def run_folder(path: Path) -> Path | None:
    """The run folder (``runs/<name>``) that ``path`` lies in: the parent of a
    ``checkpoints/``, ``history/`` or ``export/`` folder above it, beside ``checkpoints/``."""
    for folder in Path(os.path.abspath(path)).parents:
        if folder.name in RUN_FOLDERS and (folder.parent / "checkpoints").is_dir():
            return folder.parent
    return None


def default_output(src: Source, path: str | Path, fmt: str) -> Path:
    """Where ``kmoss export checkpoint PATH`` writes without ``--out``: never inside a stage's
    output (DVC would see the train or export stage changed and re-run it).

    A checkpoint ``<run>/checkpoints/step-N`` (or an archived ``<run>/history/<label>/step-N``)
    -> ``<run>/exports/<run>[-<label>]-<algo>-s<step>-<fmt>``; an adapter file inside a run
    folder -> ``<run>/exports/<file stem>-<fmt>``; any other adapter file -> beside it.
    """
    path = Path(os.path.abspath(path))
    run = run_folder(path)
    if src.kind == "file":
        name = f"{path.stem}-{fmt}{_suffix(fmt)}"
        out = (run / "exports" if run else path.parent) / name
    else:
        run = run or path.parent.parent
        label = path.parent.name if path.parent.parent.name == "history" else ""
        out = run / "exports" / export_name(run.name, src, fmt, label)
    try:
        return out.relative_to(Path.cwd())
    except ValueError:
        return out


def pick_checkpoint(run_dir: Path, which: str) -> Path:
    ckpts = list_checkpoints(run_dir / "checkpoints")
    if not ckpts:
        raise ExportError(f"{run_dir}/checkpoints holds no checkpoint; run `kmoss train` first")
    if which == "latest":
        return ckpts[-1].path
    try:
        step = int(which)
    except ValueError:
        raise ExportError(f"export.checkpoint = {which!r}: 'latest' or a step number") from None
    found = [c for c in ckpts if c.step == step]
    if not found:
        raise ExportError(f"no checkpoint of step {step} in {run_dir}/checkpoints (have "
                          f"{', '.join(str(c.step) for c in ckpts)})")
    return found[0].path


def _previous_outputs(out: Path) -> set[str]:
    """The names the last export wrote into ``out`` (its manifest), if it left one."""
    try:
        manifest = read_manifest(out, "export")
    except ArtifactError:
        return set()
    names = set(manifest.files) | set(manifest.info.get("outputs", []))
    plain = (n for n in names if isinstance(n, str) and n not in ("", ".", ".."))
    return {n for n in plain if n == Path(n).name}


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def export_run(p: Params, runs: str | Path) -> list[Path]:
    """Write the export into ``runs/<name>/export/``, replacing what the last export wrote
    there: the new files first, then the old ones (by the old manifest), then the manifest."""
    run_dir = Path(runs) / p.run.name
    out = run_dir / "export"
    ckpt = pick_checkpoint(run_dir, p.export.checkpoint)
    full = trained_config(open_checkpoint(ckpt, legacy_weights=True).state.get("trained"), ckpt).full
    formats = list(p.export.formats)
    if formats == ["auto"]:
        formats = list(FULL_DEFAULT if full else ADAPTER_DEFAULT)
    # an adapter's own files need the base's shapes only: no fp32 base in host memory
    src = None
    if not full and set(formats) <= set(ADAPTER_DEFAULT):
        try:
            src = load_source(p, ckpt, ema=p.export.ema, shapes_only=True)
        except (ExportError, TrainedError):
            raise
        except Exception as err:  # building this adapter reads the base's weights (DoRA)
            log.info("%s: this adapter is built on the base's weights (%s); loading them", ckpt,
                     type(err).__name__)
    if src is None:
        src = load_source(p, ckpt, ema=p.export.ema)
    e = p.export
    experiment = os.environ.get(EXPERIMENT_ENV, "")
    with dir_lock(run_dir, "kmoss export", wait=False):  # the run's lock: not while training
        previous = _previous_outputs(out)
        written = []
        meta = {"kohakumoss_params_hash": hash_json(stage_params(p, TRAINING_KEYS)),
                "kohakumoss_base_model": p.model.transformer, "kohakumoss_run": p.run.name}
        if experiment:
            meta["kohakumoss_experiment"] = experiment
        for fmt in formats:
            def write(src: Source) -> Path:
                return write_export(src, fmt, out / export_name(p.run.name, src, fmt, experiment),
                                    strength=e.strength, fused_qkv=e.fused_qkv, style=e.style,
                                    dtype=e.dtype, metadata=meta, rotations=e.rotations)

            try:
                path = write(src)
            except ExportError:
                raise
            except Exception as err:  # the conversion reads the base's weights (DoRA, dense deltas)
                if not src.shapes_only:
                    raise
                log.info("%s: the %s file of this adapter reads the base's weights (%s); loading "
                         "them", ckpt, fmt, type(err).__name__)
                src = load_source(p, ckpt, ema=p.export.ema)
                path = write(src)
            log.info("wrote %s", path)
            written.append(path)
            faults.point("export.write")
        names = [w.name for w in written]
        for name in sorted(previous - set(names)):
            log.info("removing %s (an earlier export)", out / name)
            _remove(out / name)
        files = [w.name for w in written if w.is_file()]
        manifest = make_manifest("export", 1, params=stage_params(p, PARAMS), inputs={},
                                 code=code_version("kohakumoss.export", "kohakumoss.formats",
                                                   "kohakumoss.adapters",
                                                   "kohakumoss.formats.trained"),
                                 directory=out, files=files,
                                 info={"checkpoint": ckpt.name, "formats": formats,
                                       "outputs": names, "experiment": experiment})
        faults.point("export.manifest")
        write_manifest(out, manifest)
    return written
