"""`kmoss check export`: read an exported adapter file the way ComfyUI does and compare the
weights it makes at a strength with what the source adapter gives there
(``comfy_semantics.verify``; ``docs/exports.md#checking-an-export``).

The expectation per weight follows the strength rules of ``docs/exports.md#strength``:
``s dW`` (what ``kmoss sample`` and the merged export give), except where the file holds
native OFT/BOFT blocks, whose slider ComfyUI applies its own way (``comfy_strength_delta``);
there the check expects ComfyUI's rule and adds a note saying how far it is from ``s dW``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from kohakumoss.config import Params
from kohakumoss.export.formats import ExportError, load_source
from kohakumoss.formats.comfy import comfy_strength_delta, layer_delta
from kohakumoss.formats.comfy_semantics import Row, load_patches, rel_error, strip_prefix, verify
from kohakumoss.formats.keys import fuse_qkv, fused_layer, fused_path, qkv_layer, qkv_paths
from kohakumoss.formats.lycoris import group_tensors, read_adapter_file
from kohakumoss.precision.dtypes import DTYPES

PATCH_DTYPES = ("fp32", "fp16", "bf16")  # fp32: ComfyUI's usual float32 copy (checked in float64)
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


class TrainedDeltas(Mapping):
    """The trained adapter's deltas at ``strength`` by base-state name (``<path>.weight`` /
    ``.bias``; fused joint q/k/v concatenated into ``layers.N.proj.qkv.weight``), computed
    lazily so a verifier can stream them at full model size. Weights named in ``blocks``
    (native OFT/BOFT blocks in the file) get ComfyUI's slider rule instead of ``s dW``."""

    def __init__(self, adapters, fused_qkv: bool = False, strength: float = 1.0,
                 blocks: frozenset[str] = frozenset()):
        self.modules, self.norms, self.fused = adapters.modules, adapters.norms, fused_qkv
        self.strength, self.blocks = float(strength), blocks
        self._names: dict[str, tuple[str, str]] = {}
        for path, lyco in self.modules.items():
            n = qkv_layer(path) if fused_qkv else None
            owner = fused_path(n) if n is not None else path
            self._names[f"{owner}.weight"] = (owner, "weight")
            if lyco.org_module[0].bias is not None:
                self._names[f"{owner}.bias"] = (owner, "bias")
        self._names.update({f"{p}.weight": (p, "norm") for p in self.norms})

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    @torch.no_grad()
    def __getitem__(self, name: str) -> torch.Tensor:
        owner, what = self._names[name]
        s = self.strength
        if what == "norm":
            n = self.norms[owner]
            return s * (n.merged_weight(1.0) - n.norm_weight.detach().to(n.w_norm.dtype))
        layer = fused_layer(owner)
        if layer is None or owner in self.modules:
            lyco = self.modules[owner]
            if what == "weight" and name in self.blocks:
                return comfy_strength_delta(lyco, s, blocks=True)
            dW, db = layer_delta(lyco)
            if what == "weight":
                return s * dW
            return s * db if db is not None else torch.zeros_like(dW[:, 0])
        paths = qkv_paths(layer)
        got = {p: s * layer_delta(self.modules[p])[0] for p in paths if p in self.modules}
        ref = next(iter(got.values()))
        return torch.cat([got.get(p, torch.zeros_like(ref)) for p in paths])


def trained_deltas(adapters, fused_qkv: bool = False, strength: float = 1.0,
                   blocks: frozenset[str] = frozenset()) -> TrainedDeltas:
    """What a comfy export of ``adapters`` must produce, for ``comfy_semantics.verify``."""
    return TrainedDeltas(adapters, fused_qkv, strength, blocks)


@dataclasses.dataclass
class ExportCheck:
    rows: list[Row]  # per weight: relative error (of the delta; of the weight when half-patched)
    unloaded: list[str]  # file keys ComfyUI would not load or apply
    notes: list[str]  # where ComfyUI's slider differs from kmoss's strength, by design
    tolerance: float  # the default bound for this file and patching dtype


def default_tolerance(tensors: Mapping[str, torch.Tensor], patch: torch.dtype) -> float:
    """Half-precision patching: 8 unit roundoffs of that dtype, on the weight (rounding the
    result alone costs about 1; ComfyUI's DoRA adds the dtype's epsilon to each norm, up to
    about 8); otherwise, on the delta, 1e-5 for a float32 (or wider) file, 5e-3 for a
    bf16 / fp16 one."""
    if patch in UNIT_ROUNDOFF:
        return 8 * UNIT_ROUNDOFF[patch]
    low = any(t.dtype in UNIT_ROUNDOFF for t in tensors.values() if t.ndim)
    return 5e-3 if low else 1e-5


def _notes(adapters, blocks: dict[str, str], strength: float) -> list[str]:
    if strength in (0.0, 1.0):
        return []
    notes = []
    for name, kind in sorted(blocks.items()):
        lyco = adapters.modules[name[:-len(".weight")]]
        ours = strength * layer_delta(lyco)[0]
        off = rel_error(comfy_strength_delta(lyco, strength, blocks=True), ours)
        notes.append(f"{name}: {kind.upper()} blocks: ComfyUI's slider at {strength:g} gives a "
                     f"change {off:.1%} off kmoss's {strength:g} x dW (kmoss sample, merged "
                     f"export); they agree at 0 and 1. Export with --rotations diff for a "
                     f"linear slider")
    return notes


def check_export(p: Params | None, file: str | Path, source: str | Path, strength: float = 1.0, *,
                 model: str | None = None, patch: str = "fp32") -> ExportCheck:
    """``source``: the training checkpoint (or adapter file) the export came from; the base
    weights are ``model`` or ``p.model.transformer``. ``file`` must be a readable adapter file.
    ``patch``: ComfyUI's patching dtype (``fp32``, or ``fp16`` / ``bf16`` of low-VRAM loads)."""
    if patch not in PATCH_DTYPES:
        raise ExportError(f"patch dtype {patch!r}: one of {', '.join(PATCH_DTYPES)}")
    file = Path(file)
    tensors, _ = read_adapter_file(file)
    src = load_source(p, source, model=model)
    if src.full:
        raise ExportError(f"{source} is a full finetune: it has no adapter to compare {file} "
                          f"with (check an adapter export against the checkpoint it came from)")
    sets, _ = group_tensors(tensors, src.model)  # keys of no layer: verify reports them
    fused = any(fused_layer(path) is not None for path in sets)
    base = {k: v.detach() for k, v in src.model.state_dict().items()}
    base = fuse_qkv(base) if fused else base
    patches, _ = load_patches(tensors, strip_prefix(base))
    blocks = {n: q.kind for n, q in patches.items()
              if q.kind in ("oft", "boft") and n[:-len(".weight")] in src.adapters.modules}
    expected = trained_deltas(src.adapters, fused, strength, frozenset(blocks))
    dtype = torch.float64 if patch == "fp32" else DTYPES[patch]
    try:
        rows, unloaded = verify(tensors, base, expected, strength, dtype)
    except ValueError as e:  # a file ComfyUI itself refuses (e.g. lora_up without lora_down)
        raise ExportError(f"{file}: {e}") from e
    return ExportCheck(rows, unloaded, _notes(src.adapters, blocks, strength),
                       default_tolerance(tensors, dtype))
