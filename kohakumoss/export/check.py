"""`kmoss check export`: read an exported adapter file the way ComfyUI does and compare the
weight deltas it makes with what the source adapter trained (``comfy_semantics.verify``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from kohakumoss.config import Params
from kohakumoss.export.formats import ExportError, load_source
from kohakumoss.formats.comfy import layer_delta
from kohakumoss.formats.comfy_semantics import Row, verify
from kohakumoss.formats.keys import fuse_qkv, fused_layer, fused_path, qkv_layer, qkv_paths
from kohakumoss.formats.lycoris import group_tensors, read_adapter_file


class TrainedDeltas(Mapping):
    """The trained adapter's exact deltas by base-state name (``<path>.weight`` / ``.bias``;
    fused joint q/k/v concatenated into ``layers.N.proj.qkv.weight``), computed lazily so a
    verifier can stream them at full model size."""

    def __init__(self, adapters, fused_qkv: bool = False):
        self.modules, self.norms, self.fused = adapters.modules, adapters.norms, fused_qkv
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
        if what == "norm":
            n = self.norms[owner]
            return n.merged_weight(1.0) - n.norm_weight.detach().to(n.w_norm.dtype)
        layer = fused_layer(owner)
        if layer is None or owner in self.modules:
            dW, db = layer_delta(self.modules[owner])
            if what == "weight":
                return dW
            return db if db is not None else torch.zeros_like(dW[:, 0])
        paths = qkv_paths(layer)
        got = {p: layer_delta(self.modules[p])[0] for p in paths if p in self.modules}
        ref = next(iter(got.values()))
        return torch.cat([got.get(p, torch.zeros_like(ref)) for p in paths])


def trained_deltas(adapters, fused_qkv: bool = False) -> TrainedDeltas:
    """What a comfy export of ``adapters`` must produce, for ``comfy_semantics.verify``."""
    return TrainedDeltas(adapters, fused_qkv)


def check_export(p: Params, file: str | Path, source: str | Path, strength: float = 1.0, *,
                 model: str | None = None) -> tuple[list[Row], list[str]]:
    """``source``: the training checkpoint (or adapter file) the export came from; the base
    weights are ``model`` or ``p.model.transformer``. ``file`` must be a readable adapter file."""
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
    expected = trained_deltas(src.adapters, fused_qkv=fused)
    try:
        return verify(tensors, base, expected, strength)
    except ValueError as e:  # a file ComfyUI itself refuses (e.g. lora_up without lora_down)
        raise ExportError(f"{file}: {e}") from e
