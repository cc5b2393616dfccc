"""State-dict key facts shared by every checkpoint format (``spec/moss-image.md`` 2, 7.2).

Our module names equal the official keys, so the official layout needs no renaming; the
ComfyUI layout differs only by an optional prefix and the fused joint ``proj.qkv``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.")
ROPE_KEY = "rope.bands"
FUSED_QKV = re.compile(r"^layers\.(\d+)\.proj\.qkv\.weight$")


def common_prefix(keys: Iterable[str]) -> str:
    """The first known prefix that every key carries, or ''."""
    keys = list(keys)
    for p in PREFIXES:
        if keys and all(k.startswith(p) for k in keys):
            return p
    return ""


def qkv_parts(layer: int) -> list[str]:
    return [f"layers.{layer}.proj.{x}.weight" for x in ("q", "k", "v")]


def fuse_qkv(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official -> ComfyUI: each joint block's q;k;v rows concatenated into ``proj.qkv``."""
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        m = re.match(r"^layers\.(\d+)\.proj\.q\.weight$", key)
        if m:
            n = int(m.group(1))
            out[f"layers.{n}.proj.qkv.weight"] = torch.cat([sd[k] for k in qkv_parts(n)], dim=0)
        elif not re.match(r"^layers\.\d+\.proj\.[kv]\.weight$", key):
            out[key] = t
    return out


def split_qkv(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI -> official: ``proj.qkv`` split into three equal row blocks."""
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        m = FUSED_QKV.match(key)
        if m:
            for name, part in zip(qkv_parts(int(m.group(1))), t.chunk(3, dim=0)):
                out[name] = part
        else:
            out[key] = t
    return out


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
