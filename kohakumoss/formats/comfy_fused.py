"""The fused q/k/v layout of ComfyUI adapter files (``docs/adapters.md#fused-qkv-repack``):
each joint block's q/k/v tensor sets become one ``layers.N.proj.qkv`` set on writing, and
are split back on reading. The q/k/v rule itself is ``formats.keys``'.

- every present part a plain LoRA set: stacked downs, a block-diagonal up holding each
  part's ``alpha / r``, ``alpha`` = total rank (exact);
- anything else: one dense ``diff`` [+ ``diff_b``] of the three deltas stacked by rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kohakumoss.adapters.sets import Sets
from kohakumoss.formats.keys import fused_layer, fused_path, qkv_layer, qkv_paths
from kohakumoss.formats.lycoris import AdapterFileError

PLAIN_LORA = frozenset({"lora_up.weight", "lora_down.weight", "alpha"})
Delta = tuple[torch.Tensor, torch.Tensor | None]


def alpha_tensor(value: float) -> torch.Tensor:
    """A file's 0-dim float32 ``alpha``."""
    return torch.tensor(float(value), dtype=torch.float32)


def repack_qkv_lora(parts: list[dict[str, torch.Tensor] | None]) -> dict[str, torch.Tensor]:
    """Plain LoRA sets of q, k, v (None: absent) -> one fused LoRA: stacked downs, block-diagonal
    up holding each part's ``alpha / r``, ``alpha`` = total rank."""
    present = [p for p in parts if p is not None]
    D = present[0]["lora_up.weight"].shape[0]
    dt = torch.promote_types(present[0]["lora_up.weight"].dtype, torch.float32)
    total = sum(p["lora_down.weight"].shape[0] for p in present)
    up, downs, col = torch.zeros(3 * D, total, dtype=dt), [], 0
    for i, p in enumerate(parts):
        if p is None:
            continue
        u, d = p["lora_up.weight"].to(dt), p["lora_down.weight"].to(dt)
        if u.shape[0] != D:
            raise ValueError(f"q/k/v LoRA parts of different widths ({u.shape[0]} vs {D}) "
                             f"cannot fuse")
        r = d.shape[0]
        a = float(p["alpha"]) if "alpha" in p else float(r)
        up[i * D:(i + 1) * D, col:col + r] = u * (a / r)
        downs.append(d)
        col += r
    return {"lora_up.weight": up, "lora_down.weight": torch.cat(downs),
            "alpha": alpha_tensor(total)}


def _fused_dense(deltas: list[Delta | None]) -> dict[str, torch.Tensor]:
    ref = next(d for d in deltas if d is not None)[0]
    diff = torch.cat([d[0] if d is not None else torch.zeros_like(ref) for d in deltas])
    if all(d is None or d[1] is None for d in deltas):
        return {"diff": diff}
    zero = torch.zeros(ref.shape[0], dtype=ref.dtype)
    return {"diff": diff, "diff_b": torch.cat([d[1] if d is not None and d[1] is not None else zero
                                               for d in deltas])}


def fuse_qkv_sets(sets: Sets, delta_of: Callable[[str], Delta]) -> Sets:
    """Each joint block's q/k/v sets -> one ``layers.N.proj.qkv`` set, in place of the q/k/v."""
    out: Sets = {}
    for path, s in sets.items():
        n = qkv_layer(path)
        if n is None:
            out[path] = s
            continue
        fused, paths = fused_path(n), qkv_paths(n)
        if fused in out:
            continue
        parts = [sets.get(p) for p in paths]
        if all(p is None or ("lora_up.weight" in p and set(p) <= PLAIN_LORA) for p in parts):
            out[fused] = repack_qkv_lora(parts)
        else:
            out[fused] = _fused_dense([delta_of(p) if p in sets else None for p in paths])
    return out


def split_fused_qkv(sets: Sets) -> Sets:
    """Fused ``layers.N.proj.qkv`` sets -> q/k/v: a plain LoRA is split by row thirds of
    ``lora_up``, each third keeping its non-zero rank columns (and those rows of
    ``lora_down``) with ``alpha * used / total`` (the same scale); a ``diff`` by row thirds."""
    out = {}
    for path, t in sets.items():
        n = fused_layer(path)
        if n is None:
            out[path] = t
            continue
        parts = qkv_paths(n)
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
