"""LyCORIS's native adapter file (``docs/formats.md``): written from an ``AdapterSet``, read
into tensor sets. Also the parts every LyCORIS-family file shares (ComfyUI's adapter files
are of that family, ``formats.comfy``): the tensor names, the stems that name a layer, and a
checked read of the safetensors file.

Keys are ``<stem>.<tensor>``: the stem ``lora_unet_<module path with . -> _>`` on write;
on read also ``lycoris_<X_>``, ``X`` and ``X`` under a checkpoint prefix
(``diffusion_model.X``, ``model.diffusion_model.X``, ``transformer.X``). Tensors are
LyCORIS's own (``lora_up.weight``, ``hada_w1_a``, ``lokr_w1``, ``oft_blocks``, ``diff``,
``w_norm`` ...), floats with ndim > 0 in the file's dtype except the tensors of
``KEEP_FP32``, 0-dim scalars float32 (``file_tensor``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from kohakumoss.adapters.inject import NETWORK_MODULE, PREFIX, lora_name
from kohakumoss.adapters.runtime import kind_of
from kohakumoss.adapters.sets import Sets, adaptable_paths
from kohakumoss.artifacts import atomic_path, write_safetensors
from kohakumoss.errors import KohakuError
from kohakumoss.formats.keys import PREFIXES, fused_path

TENSOR_NAMES = sorted([
    "lora_up.weight", "lora_down.weight", "lora_mid.weight", "alpha", "dora_scale",
    "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2",
    "lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t1", "lokr_t2",
    "oft_blocks", "rescale", "a1.weight", "a2.weight", "b1.weight", "b2.weight", "bm.weight",
    "on_input", "weight", "diff", "diff_b", "w_norm", "b_norm", "q_layer.weight",
    "p_layer.weight", "lambda_layer", "base_q", "base_p", "base_lambda"], key=len, reverse=True)
# kept in float32 in a bf16/fp16 file: scales and corrections whose rounding moves the whole
# weight rather than the delta (docs/adapters.md#adapter-files): DoRA's magnitude, OFT/BOFT's
# rescale, and T-LoRA's trained factors, whose delta is P λ Q - P0 λ0 Q0 with P0 λ0 Q0 (the
# base's top singular part, re-derived by the loader) as large as the weight
KEEP_FP32 = frozenset({"dora_scale", "rescale", "q_layer.weight", "p_layer.weight",
                       "lambda_layer"})
STYLES = (PREFIX, "diffusion_model")  # the stems a file we write names layers by
LAYOUTS = ("LyCORIS or ComfyUI adapter tensors (<stem>.lora_up.weight, .hada_w1_a, .lokr_w1, "
           ".diff ...)")


class AdapterFileError(KohakuError, ValueError):
    """An adapter file that cannot be read or applied; the message names the file."""


# -- stems ------------------------------------------------------------------------------------
def stem(path: str, style: str = PREFIX) -> str:
    """The stem a file we write names module ``path`` by: ``lora_unet_<path_>`` (LyCORIS's
    own name) or ``diffusion_model.<path>``."""
    if style == PREFIX:
        return lora_name(path)
    if style == "diffusion_model":
        return f"diffusion_model.{path}"
    raise ValueError(f"adapter key style {style!r}: one of {', '.join(STYLES)}")


def stem_index(paths: Iterable[str]) -> dict[str, str]:
    """Every stem a file may name module path X by -> X: ``X``, ``X`` under each of
    ``PREFIXES``, ``lora_unet_<X_>`` and ``lycoris_<X_>``."""
    index = {}
    for x in paths:
        index.update({f"{p}{x}": x for p in ("", *PREFIXES)})
        index.update({f"{p}_{x.replace('.', '_')}": x for p in (PREFIX, "lycoris")})
    return index


def tensor_name(key: str) -> str | None:
    """The LyCORIS tensor name ``key`` ends with (the longest), or None."""
    return next((s for s in TENSOR_NAMES if key.endswith("." + s)), None)


def file_tensor(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Tensor ``name`` (a LyCORIS tensor name) as a file of ``dtype`` stores it: floats with
    ndim > 0 in ``dtype``, those of ``KEEP_FP32`` at least float32, 0-dim scalars float32;
    a contiguous CPU copy."""
    t = t.detach().to("cpu")
    if t.is_floating_point():
        if t.ndim == 0:
            t = t.to(torch.float32)
        else:
            t = t.to(torch.promote_types(dtype, torch.float32) if name in KEEP_FP32 else dtype)
    return t.contiguous().clone()


# -- reading ----------------------------------------------------------------------------------
def read_adapter_file(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a LyCORIS-family file: a readable ``.safetensors`` file
    holding at least one adapter tensor, else an ``AdapterFileError`` naming it."""
    path = Path(path)
    if not path.exists():
        raise AdapterFileError(f"{path} does not exist: expected an adapter file (.safetensors)")
    if path.is_dir():
        raise AdapterFileError(f"{path} is a folder: expected an adapter file (.safetensors)")
    try:
        with safe_open(str(path), "pt") as f:
            keys = list(f.keys())
            if not any(tensor_name(k) not in (None, "weight") for k in keys):
                held = f"{len(keys)} tensor(s) such as {sorted(keys)[:3]}" if keys else "no tensors"
                raise AdapterFileError(f"{path} holds no adapter weights of a known layout "
                                       f"(LyCORIS / ComfyUI): {held}; expected {LAYOUTS}")
            return {k: f.get_tensor(k) for k in keys}, f.metadata() or {}
    except SafetensorError as e:
        size = path.stat().st_size
        what = "an empty file" if size == 0 else f"{size} bytes that do not parse: {e}"
        raise AdapterFileError(f"{path} is not a safetensors file ({what}); expected a complete "
                               f"adapter file (.safetensors, LyCORIS or ComfyUI)") from None


def group_tensors(sd: Mapping[str, torch.Tensor], model: nn.Module
                  ) -> tuple[Sets, list[str]]:
    """``{module path: {tensor name: tensor}}`` of the keys whose stem names a layer of
    ``model`` (its fused ``layers.N.proj.qkv`` included), and the keys that name none."""
    paths = adaptable_paths(model) + [fused_path(i) for i in range(len(getattr(model, "layers", [])))]
    index, sets, bad = stem_index(paths), {}, []
    for key, t in sd.items():
        name = tensor_name(key)
        path = name and index.get(key[:-len(name) - 1])
        if path is None:
            bad.append(key)
        else:
            sets.setdefault(path, {})[name] = t
    return sets, bad


def tensor_sets(sd: Mapping[str, torch.Tensor], model: nn.Module) -> Sets:
    """``group_tensors``' sets; a key that names no layer is an error naming it."""
    sets, bad = group_tensors(sd, model)
    if bad:
        raise AdapterFileError(f"adapter file keys match no layer of this model: {bad[:6]}"
                               f"{f' (+{len(bad) - 6} more)' if len(bad) > 6 else ''}; accepted "
                               f"stems are X, lora_unet_<X with . -> _>, lycoris_<X_>, "
                               f"diffusion_model.X, transformer.X for a module path X such as "
                               f"layers.0.proj.q")
    return sets


def read_lycoris(path: str | Path, model: nn.Module) -> tuple[Sets, dict[str, str]]:
    """A LyCORIS file's tensor sets by module path of ``model``, and its metadata."""
    sd, meta = read_adapter_file(path)
    try:
        return tensor_sets(sd, model), meta
    except AdapterFileError as e:
        raise AdapterFileError(f"{path}: {e}") from None


# -- writing ----------------------------------------------------------------------------------
def lycoris_state_dict(adapters, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """LyCORIS's native save set of an ``AdapterSet``, cast by ``file_tensor``.

    DyLoRA writes its full-rank scale as ``alpha`` (``alpha_file / r`` = ``alpha / blocks``),
    so any LoRA loader reproduces the trained layer."""
    out = {}
    for lyco in adapters.modules.values():
        sd = dict(lyco.state_dict())
        if kind_of(lyco) == "dylora":
            sd["alpha"] = lyco.alpha / lyco.block_count * lyco.lora_dim
        for k, v in sd.items():
            out[f"{lyco.lora_name}.{k}"] = file_tensor(k, v, dtype)
    for n in adapters.norms.values():
        out[f"{n.lora_name}.w_norm"] = file_tensor("w_norm", n.w_norm, dtype)
    return out


def lycoris_metadata(cfg) -> dict[str, str]:
    """The kohya / LyCORIS fields (``ss_network_*``) of an ``AdapterConfig``."""
    args = {"algo": NETWORK_MODULE[cfg.algo], "bypass_mode": cfg.mode == "bypass"}
    if cfg.dora or cfg.algo == "dora":
        args.update(weight_decompose=True, wd_on_out=bool(cfg.algo_kwargs.get("wd_on_out", True)))
    args.update(cfg.algo_kwargs)
    return {"kohakumoss_format": "lycoris", "kohakumoss_key_style": PREFIX,
            "kohakumoss_prefix": PREFIX, "kohakumoss_algo": cfg.algo,
            "ss_network_module": "lycoris.kohya", "ss_network_dim": str(cfg.dim),
            "ss_network_alpha": str(float(cfg.alpha)), "ss_network_args": json.dumps(args)}


def save_lycoris(adapters, path: str | Path, dtype: torch.dtype = torch.bfloat16,
                 metadata: Mapping[str, str] | None = None) -> Path:
    """Write an ``AdapterSet``'s LyCORIS file atomically (keys ``lora_unet_<path>.<tensor>``)."""
    meta = {**lycoris_metadata(adapters.cfg), **(metadata or {})}
    with atomic_path(path) as tmp:
        write_safetensors(lycoris_state_dict(adapters, dtype), tmp, meta)
    return Path(path)
