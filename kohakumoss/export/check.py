"""`kmoss check export`: read an exported adapter file the way ComfyUI does and compare the
weight deltas it makes with what the source adapter trained (``comfy_semantics.verify``)."""

from __future__ import annotations

from pathlib import Path

from kohakumoss.adapters.files import read_adapter_file
from kohakumoss.config import Params
from kohakumoss.export.comfy import trained_deltas
from kohakumoss.export.comfy_semantics import Row, verify
from kohakumoss.export.formats import ExportError, load_source
from kohakumoss.formats.keys import fuse_qkv


def check_export(p: Params, file: str | Path, source: str | Path, strength: float = 1.0
                 ) -> tuple[list[Row], list[str]]:
    """``source``: the training checkpoint (or adapter file) the export came from; the base
    weights are ``p.model.transformer``. ``file`` must be a readable adapter file."""
    file = Path(file)
    tensors, _ = read_adapter_file(file)
    src = load_source(p, source)
    if src.kind == "full":
        raise ExportError(f"{source} is a full finetune: it has no adapter to compare {file} "
                          f"with (check an adapter export against the checkpoint it came from)")
    fused = any("proj_qkv." in k or "proj.qkv." in k for k in tensors)
    base = {k: v.detach() for k, v in src.model.state_dict().items()}
    base = fuse_qkv(base) if fused else base
    expected = trained_deltas(src.adapters, fused_qkv=fused)
    try:
        return verify(tensors, base, expected, strength)
    except ValueError as e:  # a file ComfyUI itself refuses (e.g. lora_up without lora_down)
        raise ExportError(f"{file}: {e}") from e
