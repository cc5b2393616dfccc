"""Write an export from a source: a training checkpoint (adapter or full weights, optionally
its EMA) or a foreign LyCORIS / ComfyUI adapter file, onto the base model of ``params``.

Formats: ``comfy`` (ComfyUI-native adapter file, ``kohakumoss.export.comfy``), ``lycoris``
(lycoris-lora's own file), ``merged`` (base + adapter at a strength, a ComfyUI single file
with fused q/k/v, or the official bare layout) and ``diffusers`` (a transformer folder:
config.json, shards, index). Every output is written atomically; an existing output is
replaced only once the new one is complete. An export is a pure function of (source,
export params).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from kohakumoss.config import AdapterConfig, Params
from kohakumoss.precision.dtypes import DTYPES
from kohakumoss.errors import KohakuError
from kohakumoss.formats import load_dit
from kohakumoss.formats.model_files import save_comfy, save_official
from kohakumoss.model.dit import MOSSImageTransformer

FORMATS = ("comfy", "lycoris", "merged", "diffusers")
SOURCES = ("a training checkpoint folder (runs/<name>/checkpoints/step-N) or an adapter file "
           "(.safetensors, LyCORIS or ComfyUI)")


class ExportError(KohakuError, ValueError):
    """An export that cannot be made from this source; the message says what can."""


@dataclasses.dataclass
class Source:
    model: MOSSImageTransformer  # the base, float32
    kind: str  # "adapter" | "full" | "file"
    adapters: Any = None  # AdapterSet (checkpoint) or Attached (file)
    describe: dict = dataclasses.field(default_factory=dict)
    step: int | None = None
    path: Path | None = None


def load_source(p: Params, path: str | Path, ema: bool = False) -> Source:
    """The base model of ``p.model.transformer`` (float32, CPU) with the source applied."""
    path = Path(path)
    if not path.exists():
        raise ExportError(f"{path} does not exist: expected {SOURCES}")
    model = load_dit(p.model.transformer, torch.float32, "cpu").eval()
    from kohakumoss.training.checkpoint import is_checkpoint, open_checkpoint

    if is_checkpoint(path):
        ckpt = open_checkpoint(path, legacy_weights=True)  # every file read is verified
        trained = dict(ckpt.state["trained"])
        weights = ckpt.ema() if ema else ckpt.trainable()
        if weights is None:
            raise ExportError(f"{path} holds no EMA weights (train with optim.ema > 0)")
        if trained["algo"] == "full":
            model.load_state_dict(weights)
            return Source(model, "full", None, trained, ckpt.step, path)
        from kohakumoss.adapters import apply_adapters

        trained["targets"] = tuple(trained.get("targets", ()))
        adapters = apply_adapters(model, AdapterConfig(**trained), seed=p.run.seed)
        if ema:
            own = adapters.state_dict()
            weights = {k: weights.get(k, v) for k, v in own.items()}
        adapters.load_state_dict(weights)
        adapters.eval()
        return Source(model, "adapter", adapters, trained, ckpt.step, path)
    if path.is_file():
        from kohakumoss.adapters import load_adapter_file

        attached = load_adapter_file(model, path, multiplier=1.0, mode="bypass")
        return Source(model, "file", attached, {"algo": "file"}, None, path)
    raise ExportError(f"{path} is a folder but not a training checkpoint (none of a "
                      f"checkpoint's files is in it): expected {SOURCES}")


def _metadata(src: Source, fmt: str, extra: dict[str, str]) -> dict[str, str]:
    meta = {"kohakumoss_format": fmt, "kohakumoss_algo": str(src.describe.get("algo", ""))}
    if src.step is not None:
        meta["kohakumoss_step"] = str(src.step)
    return {**meta, **extra}


def merged_state(src: Source, strength: float) -> dict[str, torch.Tensor]:
    """Base + strength x adapter (full weights as they are), float32."""
    if src.kind == "full":
        return {k: v.detach().clone() for k, v in src.model.state_dict().items()}
    src.adapters.merge(strength)
    try:
        return {k: v.detach().clone() for k, v in src.model.state_dict().items()}
    finally:
        src.adapters.unmerge()


def _replace_dir(tmp: Path, final: Path) -> None:
    """Swap a finished folder into place; the old one is removed only afterwards."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old)


def write_export(src: Source, fmt: str, out: Path, *, strength: float = 1.0, fused_qkv: bool = True,
                 style: str = "lora_unet", dtype: str = "bf16", metadata: dict[str, str] | None = None
                 ) -> Path:
    from kohakumoss.export.comfy import STYLES

    for what, value, allowed in (("format", fmt, FORMATS), ("dtype", dtype, tuple(DTYPES)),
                                 ("style", style, STYLES)):
        if value not in allowed:
            raise ExportError(f"export {what} {value!r}: one of {', '.join(allowed)}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    dt = DTYPES[dtype]
    meta = _metadata(src, fmt, metadata or {})
    config = src.model.config
    if fmt in ("comfy", "lycoris") and src.kind == "full":
        raise ExportError("a full finetune has no adapter: export it as 'merged' or 'diffusers'")
    if fmt == "comfy":
        from kohakumoss.export.comfy import comfy_state_dict, convert_file, save_comfy_file

        if src.kind == "file":
            tensors, m = convert_file(src.model, src.path, fused_qkv=fused_qkv, style=style, dtype=dt)
        else:
            tensors, m = comfy_state_dict(src.adapters, src.model, fused_qkv=fused_qkv, style=style,
                                          dtype=dt)
        save_comfy_file(out, tensors, {**m, **meta})
    elif fmt == "lycoris":
        if src.kind != "adapter":
            raise ExportError("the lycoris format is written from a training checkpoint; a "
                              "foreign file converts to 'comfy', 'merged' or 'diffusers'")
        src.adapters.save_lycoris(out, dtype=dt, metadata={**src.adapters.lycoris_metadata(), **meta})
    elif fmt == "merged":
        state = merged_state(src, strength)
        save_comfy(state, out, config, dtype=dt, fused=fused_qkv,
                   metadata={**meta, "kohakumoss_strength": str(strength)})
    elif fmt == "diffusers":
        state = merged_state(src, strength)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            save_official(state, tmp, config, dtype=dt)
            _replace_dir(tmp, out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
    else:
        raise ExportError(f"unknown export format {fmt!r}; one of {', '.join(FORMATS)}")
    return out
