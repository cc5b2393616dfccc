"""SiTU of an up|gate linear's output with the linear's LoRA delta added inside the kernel
(``adapters/folded.py``: ``lora_situ``), forward and backward, as ``torch.library`` ops.

The LoRA delta ``h (alpha B)^T`` of the up|gate projection is as wide as its output
([tokens, 2F]). Written out, it costs a pass over that width and the base product reads it
back (or, where the base GEMM cannot accumulate, a second pass adds it). Here the base
product is written alone, and each tile of this kernel computes its own part of the delta
from ``h`` [R, r] and ``alpha B`` [2C, r] (one small ``tl.dot`` per half) before SiTU:

- forward: ``u = base_u + h Bu^T``, ``g = base_g + h Bg^T`` in fp32, ``out = situ(u, g)``
  (``triton_pointwise``'s math), rounded once;
- backward: u and g recomputed the same way, ``d = [du | dg]`` (the gradient of the
  linear's whole output, base and delta alike), rounded once to the output's dtype.

Against the unfused route (the delta rounded into the output, then SiTU) the difference is
where the one rounding of the sum falls: within the dtype's tolerance, exact in fp32 up to
the order of the sums. The dot runs on fp32 tiles: IEEE for fp32 data, TF32 for bf16 and
fp16 data, whose values TF32 holds exactly (so the products are exact either way; the
interpreter's dot also cannot take bf16 tiles).

Legend: R rows, C columns of each half, r the LoRA's rank.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kohakumoss.kernels.custom import rows2d
from kohakumoss.kernels.triton_common import check_tensors, jit, pow2, rounded
from kohakumoss.kernels.triton_pointwise import situ_grads, situ_value

FWD_TILE = (32, 128, 4)
BWD_TILE = (32, 128, 4)
"""(rows, columns, warps) of a program's tile, forward and backward: ``tl.dot`` wants 16 or
more on each side."""


@jit
def _halves(BASE, H, UP, rows, cols, R, C, RANK, sb, sh, su,
            IEEE: tl.constexpr, BLOCK_K: tl.constexpr):
    """u and g (fp32) of the tile: the base's halves plus the LoRA's delta."""
    ks = tl.arange(0, BLOCK_K)
    rmask, cmask, kmask = rows < R, cols < C, ks < RANK
    r64 = rows.to(tl.int64)[:, None]
    c64 = cols.to(tl.int64)[None, :]
    h = tl.load(H + r64 * sh + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
    bmask = kmask[:, None] & cmask[None, :]
    bu = tl.load(UP + c64 * su + ks[:, None], mask=bmask, other=0.0)  # Bu^T tile [K, C]
    bg = tl.load(UP + (c64 + C) * su + ks[:, None], mask=bmask, other=0.0)
    h, bu, bg = h.to(tl.float32), bu.to(tl.float32), bg.to(tl.float32)
    if IEEE:  # fp32 data: IEEE products; bf16 and fp16 values are exact in TF32's 10 bits
        du = tl.dot(h, bu, input_precision="ieee")
        dg = tl.dot(h, bg, input_precision="ieee")
    else:
        du = tl.dot(h, bu, input_precision="tf32")
        dg = tl.dot(h, bg, input_precision="tf32")
    m = rmask[:, None] & cmask[None, :]
    u = tl.load(BASE + r64 * sb + c64, mask=m, other=0.0).to(tl.float32) + du
    g = tl.load(BASE + r64 * sb + C + c64, mask=m, other=0.0).to(tl.float32) + dg
    return u, g, m, r64, c64


@jit
def _situ_lora_fwd(BASE, H, UP, OUT, R, C, RANK, sb, sh, su,
                   IEEE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    u, g, m, r64, c64 = _halves(BASE, H, UP, rows, cols, R, C, RANK, sb, sh, su, IEEE, BLOCK_K)
    tl.store(OUT + r64 * C + c64, rounded(situ_value(u, g), OUT.dtype.element_ty), mask=m)


@jit
def _situ_lora_bwd(GO, BASE, H, UP, D, R, C, RANK, sgo, sb, sh, su,
                   IEEE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    u, g, m, r64, c64 = _halves(BASE, H, UP, rows, cols, R, C, RANK, sb, sh, su, IEEE, BLOCK_K)
    go = tl.load(GO + r64 * sgo + c64, mask=m, other=0.0).to(tl.float32)
    du, dg = situ_grads(go, u, g)
    tl.store(D + r64 * (2 * C) + c64, rounded(du, D.dtype.element_ty), mask=m)
    tl.store(D + r64 * (2 * C) + C + c64, rounded(dg, D.dtype.element_ty), mask=m)


def _launch(base: torch.Tensor, h: torch.Tensor, tile: tuple[int, int, int]):
    R, C2 = base.shape
    block_r, block_c, num_warps = tile
    grid = (triton.cdiv(R, block_r), triton.cdiv(C2 // 2, block_c))
    meta = dict(IEEE=base.dtype == torch.float32, BLOCK_R=block_r, BLOCK_C=block_c,
                BLOCK_K=max(16, pow2(h.shape[1])), num_warps=num_warps)
    return grid, meta


def _fwd_impl(base: torch.Tensor, h: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    R, C2 = base.shape
    out = torch.empty((R, C2 // 2), dtype=base.dtype, device=base.device)
    if out.numel():
        grid, meta = _launch(base, h, FWD_TILE)
        _situ_lora_fwd[grid](base, h, up, out, R, C2 // 2, h.shape[1], base.stride(0), h.stride(0),
                             up.stride(0), **meta)
    return out


def _bwd_impl(go: torch.Tensor, base: torch.Tensor, h: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    R, C2 = base.shape
    go = rows2d(go, C2 // 2)
    d = torch.empty((R, C2), dtype=base.dtype, device=base.device)
    if d.numel():
        grid, meta = _launch(base, h, BWD_TILE)
        _situ_lora_bwd[grid](go, base, h, up, d, R, C2 // 2, h.shape[1], go.stride(0), base.stride(0),
                             h.stride(0), up.stride(0), **meta)
    return d


_fwd_op = torch.library.custom_op("kohakumoss::triton_situ_lora", _fwd_impl, mutates_args=())
_bwd_op = torch.library.custom_op("kohakumoss::triton_situ_lora_bwd", _bwd_impl, mutates_args=())


@_fwd_op.register_fake
def _(base, h, up):
    return base.new_empty((base.shape[0], base.shape[1] // 2))


@_bwd_op.register_fake
def _(go, base, h, up):
    return base.new_empty(base.shape)


def _check(base: torch.Tensor, h: torch.Tensor, up: torch.Tensor) -> None:
    check_tensors("situ_lora", base, h, up)
    R, C2 = base.shape
    if C2 % 2 or h.shape[0] != R or up.shape != (C2, h.shape[1]) or not h.dtype == up.dtype == base.dtype:
        raise ValueError(f"situ_lora (triton): base {tuple(base.shape)} {base.dtype}, h "
                         f"{tuple(h.shape)} {h.dtype}, up {tuple(up.shape)} {up.dtype}; want "
                         f"[R, 2C], [R, r] and [2C, r] of one dtype")


def situ_lora(base: torch.Tensor, h: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``situ(u, g)`` of ``[u | g] = base + h up^T`` ([R, 2C], [R, r], [2C, r]): [R, C] in
    base's dtype. No autograd of its own (``adapters.folded._LoraSitu`` owns it)."""
    _check(base, h, up)
    base, h, up = rows2d(base, base.shape[1]), rows2d(h, h.shape[1]), rows2d(up, up.shape[1])
    return _fwd_op(base, h, up) if torch.compiler.is_compiling() else _fwd_impl(base, h, up)


def situ_lora_bwd(go: torch.Tensor, base: torch.Tensor, h: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gradient [R, 2C] of ``base + h up^T`` given ``go`` [R, C], SiTU's output gradient."""
    _check(base, h, up)
    base, h, up = rows2d(base, base.shape[1]), rows2d(h, h.shape[1]), rows2d(up, up.shape[1])
    return _bwd_op(go, base, h, up) if torch.compiler.is_compiling() else _bwd_impl(go, base, h, up)
