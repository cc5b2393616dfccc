"""Adapters from tensor sets: ``{module path: {tensor name: tensor}}`` (LyCORIS's tensor
names, the layer's q/k/v already split) -> LyCORIS modules on the model's layers and
trained norm deltas, for inference (``docs/formats.md``).

``build_modules`` is what an adapter file becomes once ``kohakumoss.formats`` has read it
and named its layers; ``Attached(modules, norms, ...)`` then runs them beside the base layers
or merges them. A set without ``alpha`` has scale 1 (``alpha`` = its rank).
"""

from __future__ import annotations

import torch
from lycoris import LycorisNetwork, create_lycoris_from_weights
from lycoris.modules import IA3Module, get_module
from torch import nn

from kohakumoss.adapters.inject import PREFIX, lora_name
from kohakumoss.adapters.norms import NormDelta
from kohakumoss.adapters.runtime import master_dtype, quiet_lycoris
from kohakumoss.errors import KohakuError
from kohakumoss.model.dit import RMSNormWeight

Sets = dict[str, dict[str, torch.Tensor]]
RANK_OF = ("lora_down.weight", "hada_w1_b", "lokr_w1_b", "lokr_w2_b", "a2.weight")


class AdapterSetError(KohakuError, ValueError):
    """Tensors that make no adapter on this model; the message names the layer."""


def adaptable_paths(model: nn.Module) -> list[str]:
    """Every layer an adapter can sit on: the linears and the RMSNorm weights."""
    return [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, RMSNormWeight))]


def _default_alpha(t: dict[str, torch.Tensor]) -> torch.Tensor:
    rank = next((t[k].shape[0] for k in RANK_OF if k in t), 0)
    return torch.tensor(float(rank))


def build_modules(model: nn.Module, sets: Sets, multiplier: float
                  ) -> tuple[dict[str, nn.Module], dict[str, NormDelta]]:
    """The LyCORIS modules (by module path) and norm deltas of ``sets`` on ``model``, with the
    sets' tensors copied in at full precision; not attached yet."""
    norms, ia3, in_axis_dora, rest = {}, {}, {}, {}
    for path, t in sets.items():
        base = model.get_submodule(path)
        if isinstance(base, RMSNormWeight):
            if set(t) != {"w_norm"}:
                raise AdapterSetError(f"{path}: a norm takes only w_norm, got {sorted(t)}")
            n = norms[path] = NormDelta(lora_name(path), base, master_dtype(base.weight))
            n.w_norm.data.copy_(t["w_norm"])
        elif "on_input" in t:
            lyco = IA3Module(lora_name(path), base, multiplier, train_on_input=bool(t["on_input"]))
            lyco.weight.data.copy_(t["weight"])
            ia3[path] = lyco
        else:
            t = dict(t)
            if "alpha" not in t and "diff" not in t:
                t["alpha"] = _default_alpha(t)
            if "dora_scale" in t and t["dora_scale"].shape[0] == 1 != base.weight.shape[0]:
                in_axis_dora[path] = t.pop("dora_scale")
            rest[path] = t
    LycorisNetwork.apply_preset({"lora_prefix": PREFIX})
    sd = {f"{lora_name(p)}.{k}": v for p, t in rest.items() for k, v in t.items()}
    unknown = [p for p in rest if get_module(sd, lora_name(p))[0] is None]
    if unknown:
        raise AdapterSetError(f"no adapter kind has the tensors {sorted(rest[unknown[0]])} (layer "
                              f"{unknown[0]}): expected one kind's set: LoRA lora_up/lora_down, "
                              f"LoHa hada_*, LoKr lokr_*, OFT oft_blocks, GLoRA a1..b2, IA3 "
                              f"weight + on_input, or diff")
    with quiet_lycoris():
        network, _ = create_lycoris_from_weights(multiplier, None, model, weights_sd=sd)
    made = {lyco.lora_name: lyco for lyco in network.loras}
    modules = {p: made[lora_name(p)] for p in rest}
    modules.update(ia3)
    for path, lyco in modules.items():
        base = model.get_submodule(path)
        lyco.to(device=base.weight.device, dtype=master_dtype(base.weight, lyco)).requires_grad_(False)
        # LyCORIS built the module in float32: copy the set's tensors again at full precision
        # (T-LoRA's base_* too, when present: exact frozen factors instead of an SVD)
        own = {**dict(lyco.named_parameters()), **dict(lyco.named_buffers())}
        for k, v in sets[path].items():
            if k in own and k not in ("alpha", "on_input") and own[k].shape == v.shape:
                own[k].data.copy_(v)
        if path in in_axis_dora:
            lyco.wd, lyco.wd_on_out = True, False
            lyco.dora_scale = nn.Parameter(in_axis_dora[path].to(base.weight.device,
                                                                 master_dtype(base.weight)))
    return modules, norms
