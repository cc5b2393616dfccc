"""ComfyUI's adapter files (``docs/formats.md``, ``docs/exports.md``): written from trained
adapters or converted from any LyCORIS-family file, and read back onto a model.

Writing: every trained layer as the tensor set that ComfyUI's weight adapters evaluate to
exactly its delta at strength 1, on the split (official) or the fused-q/k/v (Comfy-Org
repack) layout. Per layer (module path -> tensor set; key style and cast come last):

- lora, locon, loha, lokr, glora: the native LyCORIS set (``use_scalar`` folded in), ``alpha`` =
  trained scale x the rank ComfyUI divides by (LoKr with no decomposed factor: scale in w1);
- + DoRA on the output axis: ``dora_scale * (||W|| + eps) / (||W + dW|| + eps)``, as ComfyUI
  normalises rows by the original ``||W||``; input-axis DoRA unchanged;
- oft (not rescaled), boft: ``oft_blocks`` [+ ``rescale``, BOFT], ``alpha`` = constraint x out
  (``rotations="diff"``: a dense ``diff``, which ComfyUI's slider scales linearly and its
  half-precision patching applies; its blocks are exact at strength 1 in float32 only);
- ia3, rescaled oft, oft/boft on a biased layer (ComfyUI's OFT ignores ``rescale``, neither
  rotates a bias), glora that ComfyUI would read as the old layout: dense ``diff`` [+ ``diff_b``];
- dylora: plain LoRA of the full rank, its scale folded into ``lora_up``, ``alpha`` = r;
- tlora: plain LoRA of rank <= 2r, unmasked, of ``s (P λ Q - P0 λ0 Q0)`` refactored without
  cancellation (``exact_low_rank``), ``alpha`` = its rank;
- trained norms: ``w_norm``.

Tensors are cast by ``lycoris.file_tensor``: the file's dtype, float32 for DoRA's magnitude
and OFT/BOFT's ``rescale``. What ComfyUI's strength slider does with each set is
``comfy_strength_delta`` (``docs/exports.md#strength``).

Fused layout (``formats.comfy_fused``): a joint block's q/k/v become one
``layers.N.proj.qkv`` layer; plain LoRA parts are repacked exactly, anything else is a dense
``diff`` [3D, D].

Reading (``load_adapter_file``): whatever ComfyUI's loader reads of the LyCORIS family --
LyCORIS native files, ComfyUI files fused or not, our own -- split back to q/k/v (a plain
LoRA by row thirds of ``lora_up``, a ``diff`` by rows) with our own files' OFT ``alpha`` and
DoRA scales turned back into LyCORIS's, then built into LyCORIS modules on the model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kohakumoss.adapters.casts import attach_cast_groups
from kohakumoss.adapters.runtime import (Attached, dylora_rank, kind_of, merged_weight,
                                         native_merged_weight, weight_delta)
from kohakumoss.adapters.sets import AdapterSetError, Sets, build_modules
from kohakumoss.artifacts import atomic_path, write_safetensors
from kohakumoss.formats.comfy_fused import (PLAIN_LORA, Delta, alpha_tensor,  # noqa: F401
                                            fuse_qkv_sets, repack_qkv_lora, split_fused_qkv)
from kohakumoss.formats.keys import qkv_layer
from kohakumoss.formats.lycoris import (AdapterFileError, file_tensor, lycoris_metadata,
                                        read_lycoris, stem)

RANK_OF = {"locon": "lora_down.weight", "loha": "hada_w1_b", "glora": "a2.weight"}
EPS_COMFY = torch.finfo(torch.float32).eps  # ComfyUI patches float32 copies of the weights
ROTATIONS = ("blocks", "diff")  # how OFT/BOFT layers are written


@torch.no_grad()
def layer_delta(lyco) -> Delta:
    """The layer's exact (dW, db) at multiplier 1 in master dtype; db None when the bias
    does not move (or there is none)."""
    dW, db = weight_delta(lyco)
    return dW, (db if db is not None and bool(db.any()) else None)


@torch.no_grad()
def exact_low_rank(up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``up @ down`` refactored in float64 as balanced factors ``U sqrt(S)``, ``sqrt(S) Vᵀ`` of
    its thin SVD (through QR of each side, so only [k, k] is decomposed): each factor's
    rounding is then relative to the product, whatever cancels inside ``up @ down``."""
    qa, ra = torch.linalg.qr(up.detach().double())
    qb, rb = torch.linalg.qr(down.detach().double().T)
    u, sv, vh = torch.linalg.svd(ra @ rb.T, full_matrices=False)
    root = sv.sqrt()
    return (qa @ u) * root, root[:, None] * (vh @ qb.T)


def _dense(delta: Delta) -> dict[str, torch.Tensor]:
    dW, db = delta
    if dW.ndim == 1:  # a norm weight
        return {"w_norm": dW}
    return {"diff": dW} if db is None else {"diff": dW, "diff_b": db}


@torch.no_grad()
def _comfy_dora(lyco, dora: torch.Tensor) -> torch.Tensor:
    if not lyco.wd_on_out:
        return dora
    lyco.wd = False  # W + dW as ComfyUI builds it from the native factors
    try:
        W1, _ = merged_weight(lyco, 1.0)
    finally:
        lyco.wd = True
    W = lyco.org_module[0].weight.detach().to(W1)
    eps = torch.finfo(dora.dtype).eps  # LyCORIS's epsilon: its dora_scale's dtype
    return dora * (W.norm(dim=1, keepdim=True) + EPS_COMFY) / (W1.norm(dim=1, keepdim=True) + eps)


def _factored(lyco, kind: str) -> dict[str, torch.Tensor]:
    """LoCon/LoHa/LoKr/GLoRA: the native set with an alpha ComfyUI reads as the trained scale."""
    s = {k: v.detach().clone() for k, v in lyco.custom_state_dict().items()}
    dora, scale = s.pop("dora_scale", None), float(lyco.scale)
    if kind == "glora":
        W = lyco.org_module[0].weight
        if W.shape[0] == W.shape[1] == s["a2.weight"].shape[0]:  # ComfyUI reads it as old GLoRA
            return _dense(layer_delta(lyco))
    if kind == "lokr":
        ranked = [k for k in ("lokr_w2_b", "lokr_w1_b") if k in s]  # ComfyUI: w2's rank wins
        if ranked:
            s["alpha"] = alpha_tensor(scale * s[ranked[0]].shape[0])
        elif scale != 1.0:  # nothing decomposed: ComfyUI's scale is 1
            s["lokr_w1"] = s["lokr_w1"] * scale
    else:
        s["alpha"] = alpha_tensor(scale * s[RANK_OF[kind]].shape[0])
    if dora is not None:
        s["dora_scale"] = _comfy_dora(lyco, dora.detach().clone())
    return s


def writes_blocks(lyco, rotations: str = "blocks") -> bool:
    """Whether this layer's ComfyUI set is native OFT/BOFT blocks (on the split layout)."""
    kind = kind_of(lyco)
    return (rotations == "blocks" and kind in ("oft", "boft") and lyco.org_module[0].bias is None
            and not (kind == "oft" and lyco.rescaled))


def _oft(lyco, kind: str, rotations: str) -> dict[str, torch.Tensor]:
    if not writes_blocks(lyco, rotations):
        return _dense(layer_delta(lyco))
    s = {"oft_blocks": lyco.oft_blocks.detach().clone(), "alpha": alpha_tensor(lyco.constraint)}
    if lyco.rescaled:
        s["rescale"] = lyco.rescale.detach().clone()
    return s


@torch.no_grad()
def layer_set(lyco, rotations: str = "blocks") -> dict[str, torch.Tensor]:
    """The ComfyUI tensor set of one LyCORIS module (unfused, master dtype); ``rotations``
    ``diff`` writes OFT/BOFT as dense deltas."""
    if rotations not in ROTATIONS:
        raise ValueError(f"rotations {rotations!r}: one of {', '.join(ROTATIONS)}")
    kind = kind_of(lyco)
    if kind in ("locon", "loha", "lokr", "glora"):
        return _factored(lyco, kind)
    if kind in ("oft", "boft"):
        return _oft(lyco, kind, rotations)
    if kind == "dylora":
        down, up, scale = lyco.get_weight(dylora_rank(lyco))  # all blocks, alpha / blocks
        return {"lora_up.weight": up.detach() * float(scale),
                "lora_down.weight": down.detach().clone(), "alpha": alpha_tensor(down.shape[0])}
    if kind == "tlora":  # s (P λ Q - P0 λ0 Q0): its two terms are as large as W, dW is not
        s = float(lyco.scale)
        up, down = exact_low_rank(torch.cat([lyco.p_layer.weight * lyco.lambda_layer * s,
                                             -(lyco.base_p * lyco.base_lambda) * s], dim=1),
                                  torch.cat([lyco.q_layer.weight, lyco.base_q], dim=0))
        return {"lora_up.weight": up, "lora_down.weight": down,
                "alpha": alpha_tensor(down.shape[0])}
    return _dense(layer_delta(lyco))  # ia3, diff


def layer_sets(modules: Mapping[str, object], norms: Mapping[str, object],
               rotations: str = "blocks") -> Sets:
    sets = {path: layer_set(lyco, rotations) for path, lyco in modules.items()}
    sets.update({path: {"w_norm": n.w_norm.detach().clone()} for path, n in norms.items()})
    return sets


def keyed(sets: Sets, style: str = "lora_unet", dtype: torch.dtype = torch.bfloat16
          ) -> dict[str, torch.Tensor]:
    """``<stem>.<tensor>`` keys, each tensor cast by ``lycoris.file_tensor`` (the file's
    ``dtype``; float32 for scalars, DoRA scales and ``rescale``)."""
    return {f"{stem(path, style)}.{name}": file_tensor(name, t, dtype)
            for path, s in sets.items() for name, t in s.items()}


@torch.no_grad()
def comfy_strength_delta(lyco, strength: float, blocks: bool) -> torch.Tensor:
    """The weight delta ComfyUI's slider at ``strength`` gives this layer (float32 patching):
    native OFT/BOFT ``blocks`` give ``s (native(s) - W)``, LyCORIS's interpolated rotation
    scaled once more (OFT: ``s² (R - I) W``; BOFT: every stage ``s R_i + (1 - s) I``, then
    ``rescale``); every other set follows the strength rule, ``s dW``."""
    if not blocks or strength in (0.0, 1.0):
        return strength * weight_delta(lyco)[0]
    Wn, _ = native_merged_weight(lyco, strength)
    return strength * (Wn - lyco.org_module[0].weight.detach().to(Wn))


def comfy_metadata(algo: str, rank: str, fused_qkv: bool, style: str, base_model: str = "",
                   params_hash: str = "", extra: Mapping[str, str] | None = None) -> dict[str, str]:
    return {**(extra or {}), "kohakumoss_format": "comfy", "kohakumoss_key_style": style,
            "kohakumoss_prefix": "lora_unet", "kohakumoss_algo": algo, "kohakumoss_rank": rank,
            "kohakumoss_fused_qkv": "1" if fused_qkv else "0", "kohakumoss_base_model": base_model,
            "kohakumoss_params_hash": params_hash}


def _check_fusable(model, paths) -> None:
    if any(qkv_layer(p) is not None for p in paths) and not hasattr(model, "layers"):
        raise ValueError("fused_qkv needs a model with joint blocks (layers.N.proj.q/k/v)")


def comfy_state_dict(adapters, model, fused_qkv: bool = False, style: str = "lora_unet",
                     dtype: torch.dtype = torch.bfloat16, base_model: str = "",
                     params_hash: str = "", rotations: str = "blocks"
                     ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of the ComfyUI file of an ``AdapterSet`` (or ``Attached``)."""
    stem("", style)  # validates the style
    sets = layer_sets(adapters.modules, adapters.norms, rotations)
    if fused_qkv:
        _check_fusable(model, sets)
        sets = fuse_qkv_sets(sets, lambda p: layer_delta(adapters.modules[p]))
    cfg = getattr(adapters, "cfg", None)
    extra = lycoris_metadata(cfg) if cfg is not None else {}
    meta = comfy_metadata(getattr(cfg, "algo", ""), str(getattr(cfg, "dim", "")), fused_qkv, style,
                          base_model, params_hash, extra)
    return keyed(sets, style, dtype), meta


def comfy_from_weight_deltas(deltas: Mapping[str, Delta], fused_qkv: bool = False,
                             style: str = "lora_unet", dtype: torch.dtype = torch.bfloat16
                             ) -> dict[str, torch.Tensor]:
    """Dense ComfyUI tensors from known deltas {module path: (dW, db or None)}: ``diff``
    [+ ``diff_b``], ``w_norm`` for 1-D (norm) weights; fused q/k/v as one dense ``diff``."""
    sets = {path: _dense(d) for path, d in deltas.items()}
    if fused_qkv:
        sets = fuse_qkv_sets(sets, lambda p: deltas[p])
    return keyed(sets, style, dtype)


def convert_file(model, src_path: str | Path, fused_qkv: bool = False, style: str = "lora_unet",
                 dtype: torch.dtype = torch.bfloat16, rotations: str = "blocks"
                 ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Rewrite any adapter file ``load_adapter_file`` reads (LyCORIS native, ComfyUI fused or
    not, our own comfy files) for ComfyUI: plain LoRA stays LoRA (repacked when fused), other
    kinds as the module docstring lists. The file is attached to ``model`` (bypass, weights
    untouched) only while it is converted."""
    stem("", style)
    with safe_open(str(src_path), "pt") as f:
        src_meta = f.metadata() or {}
    handle = load_adapter_file(model, src_path, multiplier=1.0, mode="bypass")
    try:
        sets = layer_sets(handle.modules, handle.norms, rotations)
        if fused_qkv:
            _check_fusable(model, sets)
            sets = fuse_qkv_sets(sets, lambda p: layer_delta(handle.modules[p]))
        tensors = keyed(sets, style, dtype)
    finally:
        handle.remove()
    try:
        args = json.loads(src_meta.get("ss_network_args", "{}"))
    except json.JSONDecodeError:
        args = {}
    algo = src_meta.get("kohakumoss_algo") or str(args.get("algo", ""))
    rank = src_meta.get("kohakumoss_rank") or src_meta.get("ss_network_dim", "")
    extra = {k: v for k, v in src_meta.items() if k.startswith("ss_")}
    extra["kohakumoss_source"] = Path(src_path).name
    return tensors, comfy_metadata(algo, rank, fused_qkv, style,
                                   src_meta.get("kohakumoss_base_model", ""),
                                   src_meta.get("kohakumoss_params_hash", ""), extra)


def save_comfy_file(path: str | Path, tensors: Mapping[str, torch.Tensor],
                    metadata: Mapping[str, str] | None = None) -> Path:
    """Write the file atomically (temp file, fsync, rename)."""
    with atomic_path(path) as tmp:
        write_safetensors(dict(tensors), tmp, {k: str(v) for k, v in (metadata or {}).items()})
    return Path(path)


# -- reading ----------------------------------------------------------------------------------
def _is_ours(meta: Mapping[str, str]) -> bool:
    return meta.get("kohakumoss_format") == "comfy"


def read_comfy(path: str | Path, model: nn.Module) -> tuple[Sets, dict[str, str]]:
    """Any LyCORIS-family file's tensor sets on ``model``'s (split) q/k/v layers, and its
    metadata; our own files' OFT ``alpha`` (constraint x out) back to the constraint. Our
    own DoRA scales stay ComfyUI's here (``load_adapter_file`` converts them)."""
    sets, meta = read_lycoris(path, model)  # ComfyUI's layout: LyCORIS's, fused q/k/v allowed
    try:
        sets = split_fused_qkv(sets)
    except AdapterFileError as e:
        raise AdapterFileError(f"{path}: {e}") from None
    if _is_ours(meta):
        sets = {p: {**t, "alpha": t["alpha"] / model.get_submodule(p).weight.shape[0]}
                if "oft_blocks" in t and "alpha" in t else t for p, t in sets.items()}
    return sets, meta


@torch.no_grad()
def _undo_comfy_dora(lyco: nn.Module) -> None:
    """ComfyUI normalises output-axis DoRA by ||W||; our comfy export stored
    ``dora_scale * (||W|| + eps) / (||W + dW|| + eps)``: multiply that ratio back out."""
    lyco.wd = False
    W1, _ = merged_weight(lyco, 1.0)
    lyco.wd = True
    W = lyco.org_module[0].weight.to(W1)
    eps = torch.finfo(torch.float32).eps  # the export's epsilon
    lyco.dora_scale.mul_((W1.norm(dim=1, keepdim=True) + eps) / (W.norm(dim=1, keepdim=True) + eps))


def load_adapter_file(model: nn.Module, path: str | Path, multiplier: float = 1.0,
                      mode: str = "bypass") -> Attached:
    """Attach the adapter file ``path`` (LyCORIS or ComfyUI, ``read_comfy``) to ``model`` at
    ``multiplier``; ``mode`` ``bypass`` runs it beside the base layers, ``merge`` adds
    ``m * dW`` into the weights (exact copies kept). ``handle.remove()`` restores the model
    exactly. A file that is not one, or whose keys fit no layer, is an ``AdapterFileError``."""
    if mode not in ("bypass", "merge"):
        raise ValueError(f"adapter mode {mode!r}: bypass or merge")
    sets, meta = read_comfy(path, model)
    try:
        modules, norms = build_modules(model, sets, multiplier)
    except AdapterSetError as e:
        raise AdapterFileError(f"{path}: {e}") from None
    if _is_ours(meta):
        for lyco in modules.values():
            if getattr(lyco, "wd", False) and lyco.wd_on_out:
                _undo_comfy_dora(lyco)
    handle = Attached(modules, norms, multiplier, bypass=mode == "bypass", model=model)
    handle.train(False)
    if mode == "merge":
        handle.merge(multiplier)
    else:  # each block's LoRA factors cast together per forward (adapters/casts.py)
        handle.cast_hook = attach_cast_groups(model, modules)
    return handle
