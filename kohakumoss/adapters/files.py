"""Adapter files for inference and parity (``spec/adapters-export.md`` 8.3, 8.4, 9).

``load_adapter_file(model, path, multiplier, mode)`` reads a LyCORIS native or ComfyUI
adapter file, maps its stems to the model's layers (``X``, ``lora_unet_<X_>``,
``lycoris_<X_>``, ``diffusion_model.X``, ``model.diffusion_model.X``, ``transformer.X``),
splits fused ``layers.N.proj.qkv`` layers into q/k/v, builds the modules with LyCORIS's
``create_lycoris_from_weights`` and attaches them (``bypass``) or merges them into the
weights (``merge``). The returned handle's ``remove()`` restores the model exactly.
``read_adapter_file`` refuses, naming the file, what is not a safetensors file or holds no
adapter tensors of these layouts (``AdapterFileError``).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from lycoris import LycorisNetwork, create_lycoris_from_weights
from lycoris.modules import IA3Module, get_module
from safetensors import SafetensorError, safe_open
from torch import nn

from kohakumoss.adapters.inject import PREFIX, lora_name
from kohakumoss.adapters.norms import NormDelta
from kohakumoss.adapters.runtime import (Attached, master_dtype, merged_weight,
                                         quiet_lycoris)
from kohakumoss.errors import KohakuError
from kohakumoss.formats.keys import PREFIXES
from kohakumoss.model.dit import RMSNormWeight

SUFFIXES = sorted([
    "lora_up.weight", "lora_down.weight", "lora_mid.weight", "alpha", "dora_scale",
    "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2",
    "lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t1", "lokr_t2",
    "oft_blocks", "rescale", "a1.weight", "a2.weight", "b1.weight", "b2.weight", "bm.weight",
    "on_input", "weight", "diff", "diff_b", "w_norm", "b_norm", "q_layer.weight",
    "p_layer.weight", "lambda_layer", "base_q", "base_p", "base_lambda"], key=len, reverse=True)
RANK_OF = ("lora_down.weight", "hada_w1_b", "lokr_w1_b", "lokr_w2_b", "a2.weight")
PLAIN_LORA = {"lora_up.weight", "lora_down.weight", "alpha"}
FUSED = re.compile(r"^layers\.(\d+)\.proj\.qkv$")
LAYOUTS = ("LyCORIS or ComfyUI adapter tensors (<stem>.lora_up.weight, .hada_w1_a, .lokr_w1, "
           ".diff ...)")


class AdapterFileError(KohakuError, ValueError):
    """An adapter file that cannot be read or applied; the message names the file."""


def _suffix(key: str) -> str | None:
    return next((s for s in SUFFIXES if key.endswith("." + s)), None)


def read_adapter_file(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of an adapter file: a readable ``.safetensors`` file holding
    at least one LyCORIS / ComfyUI adapter tensor, else an ``AdapterFileError`` naming it."""
    path = Path(path)
    if not path.exists():
        raise AdapterFileError(f"{path} does not exist: expected an adapter file (.safetensors)")
    if path.is_dir():
        raise AdapterFileError(f"{path} is a folder: expected an adapter file (.safetensors)")
    try:
        with safe_open(str(path), "pt") as f:
            keys = list(f.keys())
            if not any(_suffix(k) not in (None, "weight") for k in keys):
                held = f"{len(keys)} tensor(s) such as {sorted(keys)[:3]}" if keys else "no tensors"
                raise AdapterFileError(f"{path} holds no adapter weights of a known layout "
                                       f"(LyCORIS / ComfyUI): {held}; expected {LAYOUTS}")
            return {k: f.get_tensor(k) for k in keys}, f.metadata() or {}
    except SafetensorError as e:
        size = path.stat().st_size
        what = "an empty file" if size == 0 else f"{size} bytes that do not parse: {e}"
        raise AdapterFileError(f"{path} is not a safetensors file ({what}); expected a complete "
                               f"adapter file (.safetensors, LyCORIS or ComfyUI)") from None


def _layer_names(model: nn.Module) -> dict[str, str]:
    """Underscored name -> module path for every adaptable layer (+ fused joint qkv stems)."""
    paths = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, RMSNormWeight))]
    paths += [f"layers.{i}.proj.qkv" for i in range(len(getattr(model, "layers", [])))]
    return {p.replace(".", "_"): p for p in paths}


def _path_of(stem: str, names: dict[str, str]) -> str | None:
    for p in (f"{PREFIX}_", "lycoris_"):
        if stem.startswith(p) and stem[len(p):] in names:
            return names[stem[len(p):]]
    for p in (*PREFIXES, ""):
        if stem.startswith(p) and stem[len(p):] in names.values():
            return stem[len(p):]
    return None


def group_keys(sd: dict[str, torch.Tensor], model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """``{module path: {tensor suffix: tensor}}``; an unmatched key is an error naming it."""
    names, groups, bad = _layer_names(model), {}, []
    for key, t in sd.items():
        suffix = _suffix(key)
        path = suffix and _path_of(key[:-len(suffix) - 1], names)
        if path is None:
            bad.append(key)
        else:
            groups.setdefault(path, {})[suffix] = t
    if bad:
        raise AdapterFileError(f"adapter file keys match no layer of this model: {bad[:6]}"
                               f"{f' (+{len(bad) - 6} more)' if len(bad) > 6 else ''}; accepted "
                               f"stems are X, lora_unet_<X with . -> _>, lycoris_<X_>, "
                               f"diffusion_model.X, transformer.X for a module path X such as "
                               f"layers.0.proj.q")
    return groups


def split_fused_qkv(groups: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """Fused ``layers.N.proj.qkv`` layers -> q/k/v (spec 8.4): a plain LoRA is split by row
    thirds of ``lora_up``, each third keeping its non-zero rank columns (and those rows of
    ``lora_down``) with ``alpha * used / total`` (the same scale); a ``diff`` by row thirds."""
    out = {}
    for path, t in groups.items():
        m = FUSED.match(path)
        if not m:
            out[path] = t
            continue
        parts = [f"layers.{m.group(1)}.proj.{x}" for x in "qkv"]
        if set(t) <= {"diff", "diff_b"}:
            for name, *chunks in zip(parts, *(t[k].chunk(3, 0) for k in sorted(t))):
                out[name] = dict(zip(sorted(t), chunks))
        elif set(t) <= PLAIN_LORA and "lora_up.weight" in t:
            up, down = t["lora_up.weight"], t["lora_down.weight"]
            total = down.shape[0]
            alpha = float(t["alpha"]) if "alpha" in t else float(total)
            for name, up_part in zip(parts, up.chunk(3, 0)):
                used = up_part.ne(0).any(0).nonzero().flatten()
                if len(used):
                    out[name] = {"lora_up.weight": up_part[:, used], "lora_down.weight": down[used],
                                 "alpha": torch.tensor(alpha * len(used) / total)}
        else:
            raise AdapterFileError(f"fused {path} holds {sorted(t)}: only a plain LoRA or a dense "
                                   f"diff can be split into q/k/v")
    return out


def _default_alpha(t: dict[str, torch.Tensor]) -> torch.Tensor:
    rank = next((t[k].shape[0] for k in RANK_OF if k in t), 0)
    return torch.tensor(float(rank))


def _build(model: nn.Module, groups: dict[str, dict[str, torch.Tensor]], multiplier: float,
           own_comfy: bool) -> tuple[dict[str, nn.Module], dict[str, NormDelta]]:
    norms, ia3, in_axis_dora, rest = {}, {}, {}, {}
    for path, t in groups.items():
        base = model.get_submodule(path)
        if isinstance(base, RMSNormWeight):
            if set(t) != {"w_norm"}:
                raise AdapterFileError(f"{path}: a norm takes only w_norm, got {sorted(t)}")
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
            if own_comfy and "oft_blocks" in t:  # our comfy export scales alpha by out rows
                t["alpha"] = t["alpha"] / base.weight.shape[0]
            rest[path] = t
    LycorisNetwork.apply_preset({"lora_prefix": PREFIX})
    sd = {f"{lora_name(p)}.{k}": v for p, t in rest.items() for k, v in t.items()}
    unknown = [p for p in rest if get_module(sd, lora_name(p))[0] is None]
    if unknown:
        raise AdapterFileError(f"no adapter kind has the tensors {sorted(rest[unknown[0]])} (layer "
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
        # LyCORIS built the module in float32: copy the file's tensors again at full precision
        # (T-LoRA's base_* too, when present: exact frozen factors instead of an SVD)
        own = {**dict(lyco.named_parameters()), **dict(lyco.named_buffers())}
        for k, v in groups[path].items():
            if k in own and k not in ("alpha", "on_input") and own[k].shape == v.shape:
                own[k].data.copy_(v)
        if path in in_axis_dora:
            lyco.wd, lyco.wd_on_out = True, False
            lyco.dora_scale = nn.Parameter(in_axis_dora[path].to(base.weight.device,
                                                                 master_dtype(base.weight)))
        elif own_comfy and getattr(lyco, "wd", False) and lyco.wd_on_out:
            _undo_comfy_dora(lyco)
    return modules, norms


@torch.no_grad()
def _undo_comfy_dora(lyco: nn.Module) -> None:
    """ComfyUI normalises output-axis DoRA by ||W||; our comfy export stored
    ``dora_scale * (||W|| + eps) / (||W + dW|| + eps)``: multiply that ratio back out."""
    lyco.wd = False
    W1, _ = merged_weight(lyco, 1.0)
    lyco.wd = True
    W = lyco.org_module[0].weight.to(W1)
    eps = torch.finfo(torch.float32).eps  # the export's epsilon (spec 8.2)
    lyco.dora_scale.mul_((W1.norm(dim=1, keepdim=True) + eps) / (W.norm(dim=1, keepdim=True) + eps))


def load_adapter_file(model: nn.Module, path: str | Path, multiplier: float = 1.0,
                      mode: str = "bypass") -> Attached:
    """Attach the adapter in ``path`` to ``model`` at ``multiplier``; ``mode`` ``bypass`` runs
    it beside the base layers, ``merge`` adds ``m * dW`` into the weights (exact copies kept).
    ``handle.remove()`` restores the model exactly."""
    if mode not in ("bypass", "merge"):
        raise ValueError(f"adapter mode {mode!r}: bypass or merge")
    sd, meta = read_adapter_file(path)
    own_comfy = meta.get("kohakumoss_format") == "comfy"
    try:
        groups = split_fused_qkv(group_keys(sd, model))
        modules, norms = _build(model, groups, multiplier, own_comfy)
    except AdapterFileError as e:
        raise AdapterFileError(f"{path}: {e}") from None
    handle = Attached(modules, norms, multiplier, bypass=mode == "bypass")
    handle.train(False)
    if mode == "merge":
        handle.merge(multiplier)
    return handle
