"""What ComfyUI's LoRA loader does with an adapter file on a MOSS-Image model
(``docs/formats.md``, ``docs/exports.md``): an independent re-implementation, used to verify
exports (``kmoss check export``).

It deliberately imports neither LyCORIS nor any other kohakumoss module (its prefixes are its
own copy): every formula is written from ComfyUI's ``comfy/lora.py`` and
``comfy/weight_adapter/*`` (the Oct-2025 generic loader):

- key map: each model weight ``<X>.weight`` accepts the stems ``lora_unet_<X with . -> _>`` and
  ``diffusion_model.<X>`` (the model-specific extras of a MOSS-Image key map are unknown);
- per stem: ``alpha`` (``.item()``), ``dora_scale``, then the adapters in ComfyUI's order
  LoRA, LoHa, LoKr, GLoRA, OFT (3-D blocks), BOFT (4-D blocks) -- the last that matches wins --
  then ``w_norm``/``b_norm``, ``diff``/``diff_b`` and ``set_weight``, each replacing the
  stem's weight patch; ``b_norm``/``diff_b`` patch ``<X>.bias``;
- a file key no loader took, a bias patch on a layer without a bias, and a patch whose
  result does not have the weight's shape (ComfyUI logs an error and leaves the weight) are
  reported as unloaded.

Decisions: by default the math runs in float64 on the weights (ComfyUI's usual patching
uses float32 copies) so the check measures the file, not rounding; DoRA's epsilon is then
float32's, as in ComfyUI. ``dtype`` float16 / bfloat16 is ComfyUI's low-VRAM patching
(``LowVramPatch``: the weight already cast to the compute dtype, every tensor cast to it, the
math in it, DoRA's epsilon that dtype's); there its OFT/BOFT fail (the Cayley step multiplies
a half ``I + Q`` by a float32 inverse), are logged and leave the weight as it was.
OFT applies the strength twice (ComfyUI's ``(R s - s I)`` then ``s x diff``), BOFT
interpolates every stage, then scales by ``s`` once more: both are exact at strength 1 only.
OFT ignores ``rescale``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import torch

EPS = torch.finfo(torch.float32).eps  # ComfyUI patches float32 copies of the weights
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.")
# ComfyUI's LoRA key pairs (up, down, mid), first match wins
LORA_NAMES = ((".lora_up.weight", ".lora_down.weight", ".lora_mid.weight"),
              ("_lora.up.weight", "_lora.down.weight", None),
              (".lora_B.weight", ".lora_A.weight", None),
              (".lora.up.weight", ".lora.down.weight", None),
              (".lora_B", ".lora_A", None),
              (".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight", None))
LOKR_NAMES = ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b", "lokr_t2")


class PatchFailed(Exception):
    """ComfyUI would log an error for this patch and leave the weight as it was."""


@dataclasses.dataclass
class Patch:
    kind: str  # lora | loha | lokr | glora | oft | boft | diff | set
    target: str  # the base-state name it changes
    tensors: dict[str, torch.Tensor]
    alpha: float | None = None
    dora_scale: torch.Tensor | None = None
    keys: tuple[str, ...] = ()  # the file keys it came from


@dataclasses.dataclass
class Row:
    name: str
    rel_error: float  # of the weight delta; with half-precision patching, of the patched weight
    note: str = ""  # why ComfyUI did not apply the patch, when it did not


def strip_prefix(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop a checkpoint prefix that every key carries (``diffusion_model.`` etc.)."""
    for p in PREFIXES:
        if state and all(k.startswith(p) for k in state):
            return {k[len(p):]: v for k, v in state.items()}
    return dict(state)


def key_map(base_state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Stem -> base weight name, for every ``<X>.weight`` of the model."""
    out = {}
    for k in base_state:
        if k.endswith(".weight"):
            x = k[:-len(".weight")]
            out[f"lora_unet_{x.replace('.', '_')}"] = k
            out[f"diffusion_model.{x}"] = k
    return out


def _take(t: Mapping[str, torch.Tensor], loaded: set[str], *names: str
          ) -> list[torch.Tensor | None]:
    got = []
    for n in names:
        if n in t:
            loaded.add(n)
        got.append(t.get(n))
    return got


def _load_adapter(kind: str, x: str, t: Mapping[str, torch.Tensor], loaded: set[str]
                  ) -> dict[str, torch.Tensor] | None:
    """One of ComfyUI's ``Adapter.load``: the tensors it takes for stem ``x``, or None."""
    if kind == "lora":
        for up, down, mid in LORA_NAMES:
            if x + up in t:
                if x + down not in t:
                    raise ValueError(f"{x + up} without {x + down}: ComfyUI fails to load "
                                     f"this file")
                got = dict(zip(("up", "down"), _take(t, loaded, x + up, x + down)))
                if mid is not None and x + mid in t:
                    got["mid"] = _take(t, loaded, x + mid)[0]
                if x + ".reshape_weight" in t:
                    got["reshape"] = _take(t, loaded, x + ".reshape_weight")[0]
                return got
        return None
    if kind == "loha":
        if x + ".hada_w1_a" not in t:
            return None
        names = ["hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"]
        if x + ".hada_t1" in t:
            names += ["hada_t1", "hada_t2"]
        return dict(zip(names, _take(t, loaded, *(f"{x}.{n}" for n in names))))
    if kind == "lokr":
        got = {n: v for n, v in zip(LOKR_NAMES, _take(t, loaded, *(f"{x}.{n}" for n in LOKR_NAMES)))
               if v is not None}
        return got if {"lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w2_a"} & set(got) else None
    if kind == "glora":
        if x + ".a1.weight" not in t:
            return None
        names = ["a1", "a2", "b1", "b2"]
        return dict(zip(names, _take(t, loaded, *(f"{x}.{n}.weight" for n in names))))
    blocks = t.get(x + ".oft_blocks")  # oft: 3-D blocks, boft: 4-D
    if blocks is None or blocks.ndim != (3 if kind == "oft" else 4):
        return None
    got = {"blocks": _take(t, loaded, x + ".oft_blocks")[0]}
    if x + ".rescale" in t:
        got["rescale"] = _take(t, loaded, x + ".rescale")[0]
    return got


def load_patches(file_tensors: Mapping[str, torch.Tensor], base_state: Mapping[str, torch.Tensor]
                 ) -> tuple[dict[str, Patch], list[str]]:
    """ComfyUI's ``load_lora`` + ``add_patches``: {target name: patch} and the unloaded keys."""
    t, loaded, patches = file_tensors, set(), {}
    for x, target in key_map(base_state).items():
        alpha, dora = _take(t, loaded, x + ".alpha", x + ".dora_scale")
        alpha = None if alpha is None else float(alpha.item())
        for kind in ("lora", "loha", "lokr", "glora", "oft", "boft"):
            before = set(loaded)
            got = _load_adapter(kind, x, t, loaded)
            if got is not None:
                keys = tuple(sorted(loaded - before))
                patches[target] = Patch(kind, target, got, alpha, dora, keys)
        bias = target[:-len(".weight")] + ".bias"
        w_norm, diff, diff_b, set_w = (t.get(f"{x}.{n}")
                                       for n in ("w_norm", "diff", "diff_b", "set_weight"))
        if w_norm is not None:
            patches[target] = Patch("diff", target, {"diff": _take(t, loaded, x + ".w_norm")[0]},
                                    keys=(x + ".w_norm",))
            if x + ".b_norm" in t:
                patches[bias] = Patch("diff", bias, {"diff": _take(t, loaded, x + ".b_norm")[0]},
                                      keys=(x + ".b_norm",))
        if diff is not None:
            patches[target] = Patch("diff", target, {"diff": _take(t, loaded, x + ".diff")[0]},
                                    keys=(x + ".diff",))
        if diff_b is not None:
            patches[bias] = Patch("diff", bias, {"diff": _take(t, loaded, x + ".diff_b")[0]},
                                  keys=(x + ".diff_b",))
        if set_w is not None:
            patches[target] = Patch("set", target, {"diff": _take(t, loaded, x + ".set_weight")[0]},
                                    keys=(x + ".set_weight",))
    unloaded = [k for k in t if k not in loaded]
    for name in [n for n in patches if n not in base_state]:  # add_patches: "NOT LOADED"
        unloaded += patches.pop(name).keys
    return patches, sorted(unloaded)


def _f(x: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return x.detach().to("cpu", dtype)


def _half(dtype: torch.dtype) -> bool:
    return dtype in (torch.float16, torch.bfloat16)


def weight_decompose(dora: torch.Tensor, W: torch.Tensor, diff: torch.Tensor, alpha, strength: float
                     ) -> torch.Tensor:
    """ComfyUI's DoRA: output axis normalised by the ORIGINAL weight's rows, input axis by the
    columns of ``W + alpha * diff``; epsilon of the patching dtype (float32's for float64)."""
    if alpha is None:
        raise PatchFailed("DoRA without alpha")
    calc = W + diff * alpha
    dora = _f(dora, W.dtype)
    eps = torch.finfo(W.dtype).eps if _half(W.dtype) else EPS
    if dora.shape[0] == calc.shape[0]:
        norm = (W.reshape(W.shape[0], -1).norm(dim=1, keepdim=True)
                .reshape(W.shape[0], *[1] * (W.dim() - 1)))
    else:
        norm = (calc.transpose(0, 1).reshape(calc.shape[1], -1).norm(dim=1, keepdim=True)
                .reshape(calc.shape[1], *[1] * (calc.dim() - 1)).transpose(0, 1))
    calc = calc * (dora / (norm + eps))
    return calc if strength == 1.0 else W + strength * (calc - W)


def _finish(p: Patch, W: torch.Tensor, diff: torch.Tensor, scale, strength: float) -> torch.Tensor:
    if diff.shape != W.shape:
        raise PatchFailed(f"{p.kind} gives {tuple(diff.shape)} for a weight of {tuple(W.shape)}")
    if p.dora_scale is not None:
        return weight_decompose(p.dora_scale, W, diff, scale, strength)
    return W + (strength * scale) * diff


def _cayley(blocks: torch.Tensor, alpha) -> torch.Tensor:
    I = torch.eye(blocks.shape[-1], dtype=blocks.dtype)
    q = blocks - blocks.transpose(-1, -2)
    if alpha > 0:  # alpha is the Frobenius-norm limit of Q (0: none)
        q_norm = torch.norm(q) + 1e-8
        if q_norm > alpha:
            q = q * alpha / q_norm
    return (I + q) @ torch.linalg.inv(I - q)


def apply_patch(p: Patch, W: torch.Tensor, strength: float = 1.0) -> torch.Tensor:
    """The patched weight for one patch on the weight ``W``, in ``W``'s dtype (float64, or the
    half dtype of low-VRAM patching)."""
    v = {k: _f(x, W.dtype) for k, x in p.tensors.items()}
    if p.kind in ("oft", "boft") and _half(W.dtype):
        raise PatchFailed(f"ComfyUI's {p.kind.upper()} fails when patching in {W.dtype} "
                          f"(half I + Q times a float32 inverse): not applied")
    if p.kind == "diff":
        if v["diff"].shape != W.shape:
            raise PatchFailed(f"diff {tuple(v['diff'].shape)} != weight {tuple(W.shape)}")
        return W + strength * v["diff"]
    if p.kind == "set":
        return v["diff"].reshape(W.shape)
    if p.kind == "lora":
        if "reshape" in v and tuple(v["reshape"].long().tolist()) != tuple(W.shape):
            raise PatchFailed("reshape_weight pads the weight to another shape")
        up, down = v["up"], v["down"]
        scale = p.alpha / down.shape[0] if p.alpha is not None else 1.0
        if "mid" in v:
            mid = v["mid"]
            if mid.ndim != 4:
                raise PatchFailed("lora_mid of a linear layer")
            shape = [down.shape[1], down.shape[0], mid.shape[2], mid.shape[3]]
            down = (down.transpose(0, 1).flatten(1) @ mid.transpose(0, 1).flatten(1))
            down = down.reshape(shape).transpose(0, 1)
        return _finish(p, W, up.flatten(1) @ down.flatten(1), scale, strength)
    if p.kind == "loha":
        scale = p.alpha / v["hada_w1_b"].shape[0] if p.alpha is not None else 1.0
        if "hada_t1" in v:
            m1, m2 = (torch.einsum("i j ..., j r, i p -> p r ...", v[f"hada_t{i}"],
                                   v[f"hada_w{i}_b"], v[f"hada_w{i}_a"]) for i in (1, 2))
        else:
            m1, m2 = v["hada_w1_a"] @ v["hada_w1_b"], v["hada_w2_a"] @ v["hada_w2_b"]
        return _finish(p, W, m1 * m2, scale, strength)
    if p.kind == "lokr":
        dim, w1, w2 = None, v.get("lokr_w1"), v.get("lokr_w2")
        if w1 is None:
            dim, w1 = v["lokr_w1_b"].shape[0], v["lokr_w1_a"] @ v["lokr_w1_b"]
        if w2 is None:
            dim = v["lokr_w2_b"].shape[0]
            w2 = (v["lokr_w2_a"] @ v["lokr_w2_b"] if "lokr_t2" not in v else torch.einsum(
                "i j k l, j r, i p -> p r k l", v["lokr_t2"], v["lokr_w2_b"], v["lokr_w2_a"]))
        if w2.ndim == 4:
            w1 = w1[:, :, None, None]
        scale = p.alpha / dim if p.alpha is not None and dim is not None else 1.0
        return _finish(p, W, torch.kron(w1, w2), scale, strength)
    if p.kind == "glora":
        a1, a2, b1, b2 = (v[k].flatten(1) for k in ("a1", "a2", "b1", "b2"))
        old = b2.shape[1] == b1.shape[0] == a1.shape[0] == a2.shape[1]
        rank = a1.shape[0] if old else None
        if b2.shape[0] == b1.shape[1] == a1.shape[1] == a2.shape[0]:
            if not (old and a2.shape[0] == W.shape[0] and W.shape[0] == W.shape[1]):
                old, rank = False, a2.shape[0]
        if rank is None:
            raise PatchFailed("GLoRA factors of no known layout")
        scale = p.alpha / rank if p.alpha is not None else 1.0
        diff = (b2 @ b1 + (W.flatten(1) @ a2) @ a1) if old else (W @ a1) @ a2 + b1 @ b2
        if diff.numel() == W.numel():
            diff = diff.reshape(W.shape)
        return _finish(p, W, diff, scale, strength)
    if p.kind == "oft":
        blocks = v["blocks"]
        nb, bs = blocks.shape[0], blocks.shape[1]
        if W.shape[0] != nb * bs:
            raise PatchFailed(f"OFT blocks {nb}x{bs} on {W.shape[0]} rows")
        r = _cayley(blocks, p.alpha or 0)
        I = torch.eye(bs, dtype=r.dtype)
        diff = torch.einsum("k n m, k n ... -> k m ...", r * strength - strength * I,
                            W.reshape(nb, bs, *W.shape[1:])).reshape(W.shape)
        if p.dora_scale is not None:
            return weight_decompose(p.dora_scale, W, diff, p.alpha or 0, strength)
        return W + strength * diff  # strength twice: ComfyUI's OFT is exact at 1 only
    if p.kind == "boft":
        if p.alpha is None:
            raise PatchFailed("BOFT without alpha ('>' on None)")
        blocks = v["blocks"]
        m, _, b = blocks.shape[:3]
        r, I, inp = _cayley(blocks, p.alpha), torch.eye(b, dtype=W.dtype), W
        try:
            for i in range(m):
                bi, k = r[i], 2**i * (b // 2)
                if strength != 1:
                    bi = bi * strength + (1 - strength) * I
                inp = (inp.unflatten(0, (-1, 2, k)).transpose(1, 2).flatten(0, 2)
                       .unflatten(0, (-1, b)))
                inp = torch.einsum("b i j, b j ... -> b i ...", bi, inp)
                inp = inp.flatten(0, 1).unflatten(0, (-1, k, 2)).transpose(1, 2).flatten(0, 2)
        except RuntimeError as e:
            raise PatchFailed(f"BOFT blocks do not fit the weight: {e}") from None
        if "rescale" in v:
            inp = inp * v["rescale"]
        diff = inp - W
        if p.dora_scale is not None:
            return weight_decompose(p.dora_scale, W, diff, p.alpha, strength)
        return W + strength * diff
    raise AssertionError(p.kind)


def _each_patched(file_tensors, base_state, strength: float, dtype: torch.dtype):
    """Yields (name, base weight in float64, patched weight in ``dtype`` or None, keys of a
    failed patch, why) for every patched base weight, then (None, ..., unloaded keys, "")."""
    base = strip_prefix(base_state)
    patches, unloaded = load_patches(file_tensors, base)
    for name, p in patches.items():
        W = _f(base[name])
        try:
            yield name, W, apply_patch(p, W.to(dtype), strength), (), ""
        except (PatchFailed, RuntimeError) as e:
            yield name, W, None, p.keys, str(e)
    yield None, None, None, tuple(unloaded), ""


def comfy_weight_deltas(file_tensors: Mapping[str, torch.Tensor],
                        base_state: Mapping[str, torch.Tensor], strength: float = 1.0
                        ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(new - old weight for every base weight/bias the file changes, the file keys ComfyUI
    would not load or apply). ``base_state``: official or fused-q/k/v layout, any prefix."""
    deltas, unloaded, base = {}, [], strip_prefix(base_state)
    for name, W, new, failed, _ in _each_patched(file_tensors, base_state, strength, torch.float64):
        if new is not None:
            deltas[name] = (new - W).to(torch.promote_types(base[name].dtype, torch.float32))
        unloaded += failed
    return deltas, sorted(unloaded)


def rel_error(ours: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """``||ours - ref|| / ||ref||`` in float64 (absolute when ``ref`` is 0; a missing side is 0)."""
    if ours is None and ref is None:
        return 0.0
    a = _f(ours) if ours is not None else torch.zeros_like(_f(ref))
    b = _f(ref) if ref is not None else torch.zeros_like(a)
    if a.shape != b.shape:
        return float("inf")
    denom = b.norm()
    return float((a - b).norm() / denom) if denom > 0 else float((a - b).norm())


def read_file(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def verify(file: str | Path | Mapping[str, torch.Tensor], base_state: Mapping[str, torch.Tensor],
           expected_deltas: Mapping[str, torch.Tensor], strength: float = 1.0,
           dtype: torch.dtype = torch.float64) -> tuple[list[Row], list[str]]:
    """One row per weight changed by the file or expected to change, plus the keys ComfyUI
    would not load. ``dtype`` float64: the relative error of ComfyUI's weight delta against
    ``expected_deltas``; float16 / bfloat16 (low-VRAM patching): the relative error of the
    patched weight against ``W + expected`` (a patch ComfyUI fails on leaves ``W``, and says
    why in the row's note). Streams one weight at a time; ``expected_deltas`` may be lazy."""
    tensors = read_file(file) if isinstance(file, (str, Path)) else file
    rows, unloaded, seen, base = [], [], set(), strip_prefix(base_state)
    for name, W, new, failed, why in _each_patched(tensors, base_state, strength, dtype):
        unloaded += failed
        if name is None:
            continue
        seen.add(name)
        want = expected_deltas.get(name)
        if _half(dtype):
            target = W + _f(want) if want is not None else W
            rows.append(Row(name, rel_error(new if new is not None else W.to(dtype), target), why))
        else:
            rows.append(Row(name, rel_error(None if new is None else new - W, want), why))
    for n in [n for n in expected_deltas if n not in seen]:
        if _half(dtype):
            W = _f(base[n])
            rows.append(Row(n, rel_error(W.to(dtype), W + _f(expected_deltas[n]))))
        else:
            rows.append(Row(n, rel_error(None, expected_deltas[n])))
    return rows, sorted(unloaded)
