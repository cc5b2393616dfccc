"""Key rules shared by every format (``docs/formats.md``): checkpoint prefixes and the fused
q/k/v rule. (Adapter files name layers by stems: ``formats.lycoris``.)

Our module names equal the official keys, so the official layout needs no renaming; the
ComfyUI layout differs only by an optional prefix and the fused joint ``proj.qkv``.

The fused q/k/v rule lives here and only here: joint block N's attention inputs
``layers.N.proj.q``, ``.k``, ``.v`` (module paths; as weights, with ``.weight``) are, in
ComfyUI's MOSS-Image model, one layer ``layers.N.proj.qkv`` whose rows are q's, then k's,
then v's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.")
ROPE_KEY = "rope.bands"
_JOINT = re.compile(r"^layers\.(\d+)\.proj\.(q|k|v|qkv)$")


# -- the fused q/k/v rule ---------------------------------------------------------------------
def qkv_paths(layer: int) -> list[str]:
    """Joint block ``layer``'s q, k and v module paths, in the fused layer's row order."""
    return [f"layers.{layer}.proj.{x}" for x in ("q", "k", "v")]


def fused_path(layer: int) -> str:
    return f"layers.{layer}.proj.qkv"


def _joint(name: str) -> tuple[int, str] | None:
    m = _JOINT.match(name.removesuffix(".weight"))
    return (int(m.group(1)), m.group(2)) if m else None


def qkv_layer(name: str) -> int | None:
    """N when ``name`` is joint block N's q, k or v (a module path or its ``.weight``)."""
    j = _joint(name)
    return j[0] if j and j[1] != "qkv" else None


def fused_layer(name: str) -> int | None:
    """N when ``name`` is joint block N's fused ``proj.qkv`` (a module path or its ``.weight``)."""
    j = _joint(name)
    return j[0] if j and j[1] == "qkv" else None


def qkv_parts(layer: int) -> list[str]:
    """The state-dict names of joint block ``layer``'s q, k and v weights."""
    return [f"{p}.weight" for p in qkv_paths(layer)]


def fuse_qkv(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official -> ComfyUI: each joint block's q;k;v rows concatenated into ``proj.qkv``."""
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        n = qkv_layer(key) if key.endswith(".weight") else None
        if n is None:
            out[key] = t
        elif key == qkv_parts(n)[0]:
            out[f"{fused_path(n)}.weight"] = torch.cat([sd[k] for k in qkv_parts(n)], dim=0)
    return out


def split_qkv(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI -> official: ``proj.qkv`` split into three equal row blocks."""
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        n = fused_layer(key) if key.endswith(".weight") else None
        if n is None:
            out[key] = t
        else:
            out.update(zip(qkv_parts(n), t.chunk(3, dim=0)))
    return out


# -- prefixes and key checks ---------------------------------------------------------------
def common_prefix(keys: Iterable[str]) -> str:
    """The first known prefix that every key carries, or ''."""
    keys = list(keys)
    for p in PREFIXES:
        if keys and all(k.startswith(p) for k in keys):
            return p
    return ""


def check_keys(found: Iterable[str], expected: Iterable[str], where: str) -> None:
    """Strict: every expected key present, nothing unknown (``rope.bands`` is optional)."""
    found, expected = set(found) - {ROPE_KEY}, set(expected)
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} keys (e.g. {', '.join(missing[:4])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unknown keys (e.g. {', '.join(unexpected[:4])})")
        raise ValueError(f"{where} is not a complete MOSS-Image transformer: {'; '.join(parts)}. "
                         f"Point the model path at the transformer (a pipeline folder, its "
                         f"transformer/ folder, or a ComfyUI diffusion_models/*.safetensors file)")
