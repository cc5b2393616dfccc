"""Triton RMSNorm and modulated RMSNorm (``model/ops.py``: ``rms_norm``,
``modulated_rms_norm``), forward and backward, as ``torch.library`` custom ops.

Math, per row x of D features, all in fp32, rounded once to x's dtype:
``r = (mean(x^2) + eps)^-1/2``, ``xh = x r``, ``y = xh w``, modulated ``out = y (1 + sc) + sh``
with the row's sample's scale/shift. Backward, with g the output gradient:
``dsh_b = sum_{rows of b} g``, ``dsc_b = sum g y``, ``gy = g (1 + sc)``, ``dw = sum gy xh``,
``dx = r (gy w - xh mean(gy w xh))``. The reductions over rows run per (sample, chunk)
program in fp32 registers, then one fixed-order sum of the per-chunk partials.

Legend: R rows, D features, B samples, K chunks per sample, P = B K programs.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from kohakumoss.kernels.custom import entry, rows2d
from kohakumoss.kernels.triton_common import (check_tensors, jit, lastdim_contiguous, pow2,
                                              programs, rounded, row_warps, segment_order)


@jit
def _row_tile(X, sx, R, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's tile of rows in token order: row and column indices, their masks, the
    rows as int64 offsets, and x's tile in fp32."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    rmask, cmask = rows < R, cols < D
    m = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + r64 * sx + cols[None, :], mask=m, other=0.0).to(tl.float32)
    return rows, cols, rmask, cmask, m, r64, x


@jit
def _norm_fwd(X, W, SHIFT, SCALE, SEG, OUT, R, D, sx, s_sh, s_sc, eps, Y, GATE, XN, sy, s_gate,
              HAS_MOD: tl.constexpr, ADDED: tl.constexpr, BLOCK_R: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """The norm of x; with ``ADDED`` (modulated only) of ``x + gate y`` first, which is
    rounded once and stored to ``XN``, and the norm reads that rounded stream."""
    rows, cols, rmask, cmask, m, r64, x = _row_tile(X, sx, R, D, BLOCK_R, BLOCK_D)
    if HAS_MOD:
        s = tl.load(SEG + rows, mask=rmask, other=0).to(tl.int64)[:, None]
    if ADDED:
        y = tl.load(Y + r64 * sy + cols[None, :], mask=m, other=0.0).to(tl.float32)
        y = tl.load(GATE + s * s_gate + cols[None, :], mask=m, other=0.0).to(tl.float32) * y
        xr = rounded(x + y, XN.dtype.element_ty)  # as the gated add's kernel rounds it
        tl.store(XN + r64 * D + cols[None, :], xr, mask=m)
        x = xr.to(tl.float32)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    y = x * rstd[:, None] * w[None, :]
    if HAS_MOD:
        sc = tl.load(SCALE + s * s_sc + cols[None, :], mask=m, other=0.0).to(tl.float32)
        sh = tl.load(SHIFT + s * s_sh + cols[None, :], mask=m, other=0.0).to(tl.float32)
        y = y * (1.0 + sc) + sh
    tl.store(OUT + r64 * D + cols[None, :], rounded(y, OUT.dtype.element_ty), mask=m)


@jit
def _norm_bwd(G, X, W, SCALE, ORDER, STARTS, DX, PW, PSC, PSH, R, D, sg, sx, s_sc, eps, K,
              HAS_MOD: tl.constexpr, WEIGHT_GRAD: tl.constexpr, MOD_GRAD: tl.constexpr,
              BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // K
    k = pid % K
    if HAS_MOD:
        start = tl.load(STARTS + b)
        end = tl.load(STARTS + b + 1)
    else:
        start = pid * 0
        end = pid * 0 + R
    per = (end - start + K - 1) // K
    lo = start + k * per
    hi = tl.minimum(lo + per, end)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    acc_w = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc_sc = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc_sh = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_MOD:
        sc = tl.load(SCALE + b.to(tl.int64) * s_sc + cols, mask=cmask, other=0.0)
        sc = sc.to(tl.float32)[None, :]
    for i in range(lo, hi, BLOCK_R):
        idx = i + tl.arange(0, BLOCK_R)
        rmask = idx < hi
        if HAS_MOD:
            rows = tl.load(ORDER + idx, mask=rmask, other=0).to(tl.int64)[:, None]
        else:
            rows = idx.to(tl.int64)[:, None]
        m = rmask[:, None] & cmask[None, :]
        x = tl.load(X + rows * sx + cols[None, :], mask=m, other=0.0).to(tl.float32)
        g = tl.load(G + rows * sg + cols[None, :], mask=m, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
        xh = x * rstd[:, None]
        if HAS_MOD:
            if MOD_GRAD:
                acc_sh += tl.sum(g, axis=0)
                acc_sc += tl.sum(g * (xh * w), axis=0)
            g = g * (1.0 + sc)
        if WEIGHT_GRAD:
            acc_w += tl.sum(g * xh, axis=0)
        gw = g * w
        c = tl.sum(gw * xh, axis=1) / D
        dx = rstd[:, None] * (gw - xh * c[:, None])
        tl.store(DX + rows * D + cols[None, :], rounded(dx, DX.dtype.element_ty), mask=m)
    if WEIGHT_GRAD:
        tl.store(PW + pid * D + cols, acc_w, mask=cmask)
    if MOD_GRAD:
        tl.store(PSC + pid * D + cols, acc_sc, mask=cmask)
        tl.store(PSH + pid * D + cols, acc_sh, mask=cmask)


@jit
def _norm_bwd_rows(G, X, W, SCALE, SEG, RES, DX, R, D, sg, sx, s_sc, s_res, eps, GATE, DY, s_gate,
                   HAS_MOD: tl.constexpr, HAS_RES: tl.constexpr, GATED: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """``dx`` alone (no reduction over rows): tiles of rows in token order, each row's
    scale fetched through its sample, as the forward reads them; with ``HAS_RES`` the
    gradient ``RES`` that reached x by another path is added before the one rounding. With
    ``GATED`` (modulated; x = x' + gate y made by the forward's ``ADDED``) also the branch's
    gradient ``DY = gate dx``, from dx as rounded (as the gated add's backward reads it)."""
    rows, cols, rmask, cmask, m, r64, x = _row_tile(X, sx, R, D, BLOCK_R, BLOCK_D)
    g = tl.load(G + r64 * sg + cols[None, :], mask=m, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    xh = x * rstd[:, None]
    if HAS_MOD:
        s = tl.load(SEG + rows, mask=rmask, other=0).to(tl.int64)[:, None]
        g = g * (1.0 + tl.load(SCALE + s * s_sc + cols[None, :], mask=m, other=0.0).to(tl.float32))
    gw = g * w
    c = tl.sum(gw * xh, axis=1) / D
    dx = rstd[:, None] * (gw - xh * c[:, None])
    if HAS_RES:
        dx += tl.load(RES + r64 * s_res + cols[None, :], mask=m, other=0.0).to(tl.float32)
    dx = rounded(dx, DX.dtype.element_ty)
    tl.store(DX + r64 * D + cols[None, :], dx, mask=m)
    if GATED:
        gate = tl.load(GATE + s * s_gate + cols[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(DY + r64 * D + cols[None, :], rounded(gate * dx.to(tl.float32), DY.dtype.element_ty),
                 mask=m)


def _tile(D: int) -> tuple[int, int]:
    block_d = pow2(D)
    return max(1, min(64, 4096 // block_d)), block_d


LAUNCH: Mapping[str, tuple[int, int]] = types.MappingProxyType({})
"""(rows per program, warps) of a row kernel's launch, by kind (``forward``: the norm,
``added``: the norm that makes the closing add, ``rows``: dx alone, ``gated``: dx and the
branch's gradient), where one is better than the default (``_tile``'s rows, ``row_warps``):
none, as ``bench/bench_norm_launch.py`` measured at the model's sizes on the H200."""


def _launch(kind: str, D: int, launch: tuple[int, int] | None = None) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, warps) of a row kernel of ``kind``: ``launch`` (rows per program,
    warps: a sweep's), else ``LAUNCH``'s, else the default."""
    block_r, block_d = _tile(D)
    block_r, warps = launch or LAUNCH.get(kind, (block_r, row_warps(block_r * block_d)))
    return block_r, block_d, warps


def _forward(x, w, shift, scale, seg, eps, has_mod, added=None, launch=None):
    """The norm's output; with ``added`` = (y, gate), (the norm of x + gate y, x + gate y)."""
    R, D = x.shape
    out = torch.empty((R, D), dtype=x.dtype, device=x.device)
    y, gate = added if added is not None else (x, x)
    xn = torch.empty((R, D), dtype=x.dtype, device=x.device) if added is not None else out
    if R > 0:
        block_r, block_d, warps = _launch("forward" if added is None else "added", D, launch)
        s_sh, s_sc = (shift.stride(0), scale.stride(0)) if has_mod else (0, 0)
        _norm_fwd[(triton.cdiv(R, block_r),)](
            x, w, shift, scale, seg, out, R, D, x.stride(0), s_sh, s_sc, eps, y, gate, xn,
            y.stride(0), gate.stride(0), HAS_MOD=has_mod, ADDED=added is not None,
            BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps)
    return out if added is None else (out, xn)


def _backward(g, x, w, scale, seg, eps, has_mod, weight_grad, mod_grad, res=None, launch=None):
    """(dx, dw or [0], dshift and dscale in fp32 or [0, D]). Without a reduction to make,
    every program takes one tile of rows in token order (``_norm_bwd_rows``, which adds
    ``res`` [R, D], x's gradient by another path, where given); with one, B K programs walk
    their chunks of each sample's rows (``res``: added after)."""
    R, D = x.shape
    g = rows2d(g, D)
    B = scale.shape[0] if has_mod else 1
    block_r, block_d = _tile(D)
    f32 = dict(dtype=torch.float32, device=x.device)
    dx = torch.empty((R, D), dtype=x.dtype, device=x.device)
    if not (weight_grad or (has_mod and mod_grad)):  # dx alone: rows in order, no partials
        if R > 0:
            res = None if res is None else rows2d(res, D)
            rows, _, warps = _launch("rows", D, launch)
            _norm_bwd_rows[(triton.cdiv(R, rows),)](
                g, x, w, scale, seg, g if res is None else res, dx, R, D, g.stride(0),
                x.stride(0), scale.stride(0) if has_mod else 0, 0 if res is None else res.stride(0),
                eps, g, g, 0, HAS_MOD=has_mod, HAS_RES=res is not None, GATED=False,
                BLOCK_R=rows, BLOCK_D=block_d, num_warps=warps)
        empty = torch.empty((0, D), **f32)
        return dx, torch.empty((0,), dtype=w.dtype, device=x.device), empty, empty
    if res is not None:
        dx, dw, dshift, dscale = _backward(g, x, w, scale, seg, eps, has_mod, weight_grad, mod_grad)
        return dx + res.reshape(dx.shape).to(dx.dtype), dw, dshift, dscale
    K = max(1, triton.cdiv(programs(x.device), B))
    P = B * K
    pw = torch.empty((P, D) if weight_grad else (1, 1), **f32)
    psc = torch.empty((P, D) if has_mod and mod_grad else (1, 1), **f32)
    psh = torch.empty_like(psc)
    if R > 0:
        order, starts = segment_order(seg, B) if has_mod else (seg, seg)
        _norm_bwd[(P,)](g, x, w, scale, order, starts, dx, pw, psc, psh, R, D, g.stride(0),
                        x.stride(0), scale.stride(0) if has_mod else 0, eps, K,
                        HAS_MOD=has_mod, WEIGHT_GRAD=weight_grad, MOD_GRAD=has_mod and mod_grad,
                        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=row_warps(block_r * block_d))
    elif weight_grad or mod_grad:
        pw.zero_(), psc.zero_(), psh.zero_()
    dw = pw.sum(0).to(w.dtype) if weight_grad else torch.empty((0,), dtype=w.dtype, device=x.device)
    if not (has_mod and mod_grad):
        return dx, dw, torch.empty((0, D), **f32), torch.empty((0, D), **f32)
    return dx, dw, psh.view(B, K, D).sum(1), psc.view(B, K, D).sum(1)  # fp32: cast by autograd


def backward_added(g, s, w, scale, seg, eps, res, gate, y_dtype, launch=None):
    """The backward of ``(norm(s), s)`` with ``s = x + gate y`` (the forward's ``added``), when
    only x and y take gradients: ``(ds, dy)``, ``ds`` the norm's gradient of s plus ``res`` (s's
    gradient by the later add; None: none), which is x's gradient too, and ``dy = gate ds``;
    one pass over the rows."""
    R, D = s.shape
    g = rows2d(g, D)
    res = None if res is None else rows2d(res, D)
    ds = torch.empty((R, D), dtype=s.dtype, device=s.device)
    dy = torch.empty((R, D), dtype=y_dtype, device=s.device)
    if R > 0:
        block_r, block_d, warps = _launch("gated", D, launch)
        _norm_bwd_rows[(triton.cdiv(R, block_r),)](
            g, s, w, scale, seg, g if res is None else res, ds, R, D, g.stride(0), s.stride(0),
            scale.stride(0), 0 if res is None else res.stride(0), eps, gate, dy, gate.stride(0),
            HAS_MOD=True, HAS_RES=res is not None, GATED=True, BLOCK_R=block_r, BLOCK_D=block_d,
            num_warps=warps)
    return ds, dy


# ---- custom ops ----------------------------------------------------------------------------

def _rms_norm_impl(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _forward(x, weight, x, x, x, eps, False)


_rms_norm_op = torch.library.custom_op("kohakumoss::triton_rms_norm", _rms_norm_impl,
                                       mutates_args=())


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty((x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)


def _rms_norm_bwd_impl(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                       weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dw, _, _ = _backward(g, x, weight, x, x, eps, False, weight_grad, False)
    return dx, dw


_rms_norm_bwd_op = torch.library.custom_op("kohakumoss::triton_rms_norm_bwd", _rms_norm_bwd_impl,
                                           mutates_args=())


@_rms_norm_bwd_op.register_fake
def _(g, x, weight, eps, weight_grad):
    return (torch.empty((x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device),
            torch.empty(weight.shape if weight_grad else (0,), dtype=weight.dtype, device=x.device))


def _rms_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_backward(ctx, g):
    x, weight = ctx.saved_tensors
    weight_grad = ctx.needs_input_grad[1]
    dx, dw = ctx.bwd(g, x, weight, ctx.eps, weight_grad)
    return dx, dw if weight_grad else None, None


_rms_norm = entry(_rms_norm_op, _rms_norm_impl, _rms_setup, _rms_backward, _rms_norm_bwd_op,
                  _rms_norm_bwd_impl)


def _mod_norm_impl(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                   seg: torch.Tensor, eps: float) -> torch.Tensor:
    return _forward(x, weight, shift, scale, seg, eps, True)


_mod_norm_op = torch.library.custom_op("kohakumoss::triton_modulated_rms_norm", _mod_norm_impl,
                                       mutates_args=())


@_mod_norm_op.register_fake
def _(x, weight, shift, scale, seg, eps):
    return torch.empty((x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)


def _mod_norm_bwd_impl(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       seg: torch.Tensor, eps: float, weight_grad: bool, mod_grad: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(g, x, weight, scale, seg, eps, True, weight_grad, mod_grad)


_mod_norm_bwd_op = torch.library.custom_op("kohakumoss::triton_modulated_rms_norm_bwd",
                                           _mod_norm_bwd_impl, mutates_args=())


@_mod_norm_bwd_op.register_fake
def _(g, x, weight, scale, seg, eps, weight_grad, mod_grad):
    mod = scale.shape if mod_grad else (0, scale.shape[1])
    return (torch.empty((x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device),
            torch.empty(weight.shape if weight_grad else (0,), dtype=weight.dtype, device=x.device),
            torch.empty(mod, dtype=torch.float32, device=x.device),
            torch.empty(mod, dtype=torch.float32, device=x.device))


def _mod_setup(ctx, inputs, output):
    x, weight, shift, scale, seg, eps = inputs
    ctx.save_for_backward(x, weight, scale, seg)
    ctx.eps, ctx.dtypes = eps, (shift.dtype, scale.dtype)


def _mod_backward(ctx, g):
    x, weight, scale, seg = ctx.saved_tensors
    need = ctx.needs_input_grad
    mod_grad = need[2] or need[3]
    dx, dw, dshift, dscale = ctx.bwd(g, x, weight, scale, seg, ctx.eps, need[1], mod_grad)
    return (dx, dw if need[1] else None, dshift.to(ctx.dtypes[0]) if need[2] else None,
            dscale.to(ctx.dtypes[1]) if need[3] else None, None, None)


_mod_norm = entry(_mod_norm_op, _mod_norm_impl, _mod_setup, _mod_backward, _mod_norm_bwd_op,
                  _mod_norm_bwd_impl)


# ---- the op-table entries (the references' signatures) -------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``ops.rms_norm`` in Triton: x of any leading shape, normalised over its last dim."""
    check_tensors("rms_norm", x, weight)
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"rms_norm (triton): weight {tuple(weight.shape)} for {D} features")
    out = _rms_norm(rows2d(x, D), lastdim_contiguous(weight), float(eps))
    return out.view(x.shape)


def _check_mod(x_ND, weight, shift_BD, scale_BD, seg_N) -> None:
    check_tensors("modulated_rms_norm", x_ND, weight, shift_BD, scale_BD)
    N, D = x_ND.shape
    if weight.shape != (D,) or shift_BD.shape != scale_BD.shape or shift_BD.shape[-1:] != (D,) \
            or shift_BD.dim() != 2 or seg_N.shape != (N,):
        raise ValueError(f"modulated_rms_norm (triton): x {tuple(x_ND.shape)}, weight "
                         f"{tuple(weight.shape)}, shift {tuple(shift_BD.shape)}, scale "
                         f"{tuple(scale_BD.shape)}, seg {tuple(seg_N.shape)}; want [N, D], [D], "
                         f"[B, D], [B, D], [N]")


def modulated_rms_norm(x_ND: torch.Tensor, weight: torch.Tensor, shift_BD: torch.Tensor,
                       scale_BD: torch.Tensor, seg_N: torch.Tensor, eps: float) -> torch.Tensor:
    """``ops.modulated_rms_norm`` in Triton. ``seg_N`` values must lie in [0, B)."""
    _check_mod(x_ND, weight, shift_BD, scale_BD, seg_N)
    return _mod_norm(lastdim_contiguous(x_ND), lastdim_contiguous(weight),
                     lastdim_contiguous(shift_BD), lastdim_contiguous(scale_BD), seg_N, float(eps))
