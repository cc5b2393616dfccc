"""`kmoss check export`: read an exported adapter file the way ComfyUI does and compare the
weight deltas it makes with what the source adapter trained (``comfy_semantics.verify``)."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

from kohakumoss.config import Params
from kohakumoss.export.comfy import trained_deltas
from kohakumoss.export.comfy_semantics import Row, verify
from kohakumoss.export.formats import load_source
from kohakumoss.model.checkpoints.keys import fuse_qkv


def _is_fused(path: Path) -> bool:
    with safe_open(str(path), "pt") as f:
        return any("proj_qkv." in k or "proj.qkv." in k for k in f.keys())


def check_export(p: Params, file: str | Path, source: str | Path, strength: float = 1.0
                 ) -> tuple[list[Row], list[str]]:
    """``source``: the training checkpoint (or adapter file) the export came from; the base
    weights are ``p.model.transformer``."""
    file = Path(file)
    src = load_source(p, source)
    fused = _is_fused(file)
    base = {k: v.detach() for k, v in src.model.state_dict().items()}
    base = fuse_qkv(base) if fused else base
    expected = trained_deltas(src.adapters, fused_qkv=fused)
    return verify(file, base, expected, strength)
