"""Write an export from a source: a training checkpoint (adapter or full weights, optionally
its EMA) or a foreign LyCORIS / ComfyUI adapter file, onto a base model (``docs/exports.md``).

The base is ``--model`` (``"tiny"`` or a model path) or ``params``' ``model.transformer``.
Formats, each read and written by its module of ``kohakumoss.formats``
(``docs/formats.md``): ``comfy`` (ComfyUI's adapter file, ``formats.comfy``), ``lycoris``
(``formats.lycoris``), ``merged`` (``formats.merged``) and ``diffusers``
(``formats.diffusers``). Every output is written atomically; an existing output is replaced
only once the new one is complete. An export is a pure function of (source, export params).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from kohakumoss.config import Params
from kohakumoss.errors import KohakuError
from kohakumoss.formats import comfy, diffusers, dit_shapes, load_dit, lycoris, merged
from kohakumoss.model.dit import MOSSImageTransformer
from kohakumoss.precision.dtypes import DTYPES
from kohakumoss.formats.checkpoint import is_checkpoint
from kohakumoss.formats.trained import load_trained

log = logging.getLogger(__name__)

FORMATS = ("comfy", "lycoris", "merged", "diffusers")
# LyCORIS tensors ComfyUI's loader has no adapter for (it logs and skips them)
COMFY_SKIPS = {"ia3": ("weight", "on_input"),
               "tlora": ("q_layer.weight", "p_layer.weight", "lambda_layer")}
SOURCES = ("a training checkpoint folder (runs/<name>/checkpoints/step-N) or an adapter file "
           "(.safetensors, LyCORIS or ComfyUI)")


class ExportError(KohakuError, ValueError):
    """An export that cannot be made from this source; the message says what can."""


@dataclasses.dataclass
class Source:
    model: MOSSImageTransformer  # the base, float32 (meta: its shapes only, ``shapes_only``)
    kind: str  # "adapter" | "full" | "file"
    adapters: Any = None  # AdapterSet (checkpoint) or Attached (file)
    describe: dict = dataclasses.field(default_factory=dict)
    step: int | None = None
    path: Path | None = None

    @property
    def full(self) -> bool:
        """A full finetune's weights, no adapter (``load_trained`` decided it)."""
        return self.kind == "full"

    @property
    def shapes_only(self) -> bool:
        """The base is its shapes (meta device): an adapter's own tensors are exported."""
        return any(p.is_meta for p in self.model.parameters())


def base_model(p: Params | None, model: str | None, source: str | Path) -> str:
    """The base a source is applied to: ``model`` if given, else ``p.model.transformer``."""
    if model is not None:
        return model
    if p is None:
        raise ExportError(f"no base model to apply {source} to, and no params file to take "
                          f"model.transformer from: give --model (tiny or a model path: a "
                          f"pipeline folder, its transformer/ folder or a .safetensors file), or "
                          f"--params FILE (default params.yaml) whose model.transformer names it")
    return p.model.transformer


def load_source(p: Params | None, path: str | Path, ema: bool = False, *,
                model: str | None = None, shapes_only: bool = False) -> Source:
    """The base model (``model``, else ``p.model.transformer``; float32, CPU) with the source
    applied: a checkpoint through ``load_trained``, an adapter file in bypass mode.
    ``shapes_only`` (a training checkpoint's adapter): the base on the meta device, read from
    its header alone (``formats.dit_shapes``), the adapter on the CPU: what the ``comfy`` and
    ``lycoris`` files of most adapters need (``export_run`` loads the weights where building
    the adapter or a conversion reads them: DoRA)."""
    path = Path(path)
    if not path.exists():
        raise ExportError(f"{path} does not exist: expected {SOURCES}")
    if not is_checkpoint(path) and not path.is_file():
        raise ExportError(f"{path} is a folder but not a training checkpoint (none of a "
                          f"checkpoint's files is in it): expected {SOURCES}")
    if shapes_only and not is_checkpoint(path):
        raise ExportError(f"{path}: a foreign adapter file converts against the base's weights")
    base = dit_shapes(base_model(p, model, path)) if shapes_only else \
        load_dit(base_model(p, model, path), torch.float32, "cpu").eval()
    if is_checkpoint(path):
        t = load_trained(base, path, ema=ema, seed=p.run.seed if p is not None else 0)
        return Source(base, "full" if t.full else "adapter", t.adapters, t.trained, t.step, path)
    attached = comfy.load_adapter_file(base, path, multiplier=1.0, mode="bypass")
    return Source(base, "file", attached, {"algo": "file"}, None, path)


def _metadata(src: Source, fmt: str, extra: dict[str, str]) -> dict[str, str]:
    meta = {"kohakumoss_format": fmt, "kohakumoss_algo": str(src.describe.get("algo", ""))}
    if src.step is not None:
        meta["kohakumoss_step"] = str(src.step)
    return {**meta, **extra}


def merged_state(src: Source, strength: float) -> dict[str, torch.Tensor]:
    """Base + strength x adapter (full weights as they are), float32."""
    return merged.merged_state(src.model, src.adapters, strength)


def _warn_lycoris_in_comfy(src: Source, out: Path) -> None:
    """Say so when ComfyUI cannot load a LyCORIS file (IA3, T-LoRA), and name the file it loads."""
    kinds = [comfy.kind_of(m) for m in src.adapters.modules.values()]
    for kind, names in COMFY_SKIPS.items():
        if kind in kinds:
            log.warning("%s: ComfyUI does not load this LyCORIS file's %s tensors (%d keys: %s "
                        "of %d layers); it is for lycoris-lora and kmoss. For ComfyUI use the "
                        "comfy file (export format 'comfy', which export.formats auto writes "
                        "beside it), which loads", out, "IA3" if kind == "ia3" else "T-LoRA",
                        len(names) * kinds.count(kind), ", ".join(names), kinds.count(kind))


def write_export(src: Source, fmt: str, out: Path, *, strength: float = 1.0, fused_qkv: bool = True,
                 style: str = "lora_unet", dtype: str = "bf16",
                 metadata: dict[str, str] | None = None, rotations: str = "blocks") -> Path:
    """Write ``src`` as ``fmt`` to ``out``. ``rotations`` (comfy only): OFT/BOFT as native
    ``blocks`` (compact; ComfyUI's slider is exact at 1 only) or dense ``diff`` (linear at every
    strength, also in ComfyUI's half-precision patching; far larger)."""
    for what, value, allowed in (("format", fmt, FORMATS), ("dtype", dtype, tuple(DTYPES)),
                                 ("style", style, lycoris.STYLES),
                                 ("rotations", rotations, comfy.ROTATIONS)):
        if value not in allowed:
            raise ExportError(f"export {what} {value!r}: one of {', '.join(allowed)}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    dt = DTYPES[dtype]
    meta = _metadata(src, fmt, metadata or {})
    config = src.model.config
    if fmt in ("comfy", "lycoris") and src.full:
        raise ExportError("a full finetune has no adapter: export it as 'merged' or 'diffusers'")
    if fmt == "comfy":
        if src.kind == "file":
            tensors, m = comfy.convert_file(src.model, src.path, fused_qkv=fused_qkv, style=style,
                                            dtype=dt, rotations=rotations)
        else:
            tensors, m = comfy.comfy_state_dict(src.adapters, src.model, fused_qkv=fused_qkv,
                                                style=style, dtype=dt, rotations=rotations)
        comfy.save_comfy_file(out, tensors, {**m, **meta})
    elif fmt == "lycoris":
        if src.kind != "adapter":
            raise ExportError("the lycoris format is written from a training checkpoint; a "
                              "foreign file converts to 'comfy', 'merged' or 'diffusers'")
        lycoris.save_lycoris(src.adapters, out, dtype=dt, metadata=meta)
        _warn_lycoris_in_comfy(src, out)
    elif fmt == "merged":
        merged.save_merged(merged_state(src, strength), out, config, dtype=dt, fused_qkv=fused_qkv,
                           strength=strength, metadata=meta)
    else:
        diffusers.save_diffusers(merged_state(src, strength), out, config, dtype=dt)
    return out
