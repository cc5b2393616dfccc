"""The export stage: the run's newest (or chosen) checkpoint in the configured formats."""

from __future__ import annotations

import logging
from pathlib import Path

from kohakumoss.artifacts import code_version, hash_json, make_manifest, write_manifest
from kohakumoss.config import Params, stage_params
from kohakumoss.export.formats import ExportError, load_source, output_name, write_export
from kohakumoss.training.checkpoint import list_checkpoints

log = logging.getLogger(__name__)

PARAMS = ["run.name", "run.seed", "model.transformer", "export"]
TRAINING_KEYS = ["adapter", "optim", "objective", "train"]
ADAPTER_DEFAULT = ("comfy", "lycoris")
FULL_DEFAULT = ("merged",)


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


def export_run(p: Params, runs: str | Path) -> list[Path]:
    run_dir = Path(runs) / p.run.name
    out = run_dir / "export"
    ckpt = pick_checkpoint(run_dir, p.export.checkpoint)
    src = load_source(p, ckpt, ema=p.export.ema)
    formats = list(p.export.formats)
    if formats == ["auto"]:
        formats = list(FULL_DEFAULT if src.kind == "full" else ADAPTER_DEFAULT)
    e = p.export
    written = []
    meta = {"kohakumoss_params_hash": hash_json(stage_params(p, TRAINING_KEYS)),
            "kohakumoss_base_model": p.model.transformer}
    for fmt in formats:
        path = write_export(src, fmt, out / output_name(p.run.name, fmt), strength=e.strength,
                            fused_qkv=e.fused_qkv, style=e.style, dtype=e.dtype, metadata=meta)
        log.info("wrote %s", path)
        written.append(path)
    files = [w.name for w in written if w.is_file()]
    manifest = make_manifest("export", 1, params=stage_params(p, PARAMS), inputs={},
                             code=code_version("kohakumoss.export", "kohakumoss.adapters"),
                             directory=out, files=files,
                             info={"checkpoint": ckpt.name, "formats": formats})
    write_manifest(out, manifest)
    return written
