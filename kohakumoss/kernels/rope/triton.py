"""Triton qk-norm + split-half RoPE (``model/ops.py``: ``qk_norm_rope``), forward and
backward, as ``torch.library`` custom ops.

Math, per token n and head h, with x = [x1 | x2] (halves of Dh/2), all in fp32, rounded
once to x's dtype: ``r = (mean(x^2) + eps)^-1/2``, ``y = x r w`` (one [Dh] weight for all
heads), ``o1 = y1 c - y2 s``, ``o2 = y2 c + y1 s`` with the token's cos/sin [Dh/2].
Backward, with g = [g1 | g2]: ``dy1 = g1 c + g2 s``, ``dy2 = g2 c - g1 s``;
``dw = sum_{n,h} dy x r``; ``dx = r (dy w - xh mean(dy w xh))`` per head;
``dc = sum_h (g1 y1 + g2 y2)``, ``ds = sum_h (g2 y1 - g1 y2)`` when cos/sin need gradients.

Legend: N tokens, H heads, Dh head dim, P programs of the backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kohakumoss.kernels.custom import entry
from kohakumoss.kernels.triton_common import (check_tensors, jit, lastdim_contiguous, pow2,
                                              programs, rounded, row_warps)


@jit
def _qk_fwd(X, W, COS, SIN, OUT, N, sxn, sxh, scn, ssn, H, eps, HALF: tl.constexpr,
            BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_J)
    t64 = t.to(tl.int64)
    tj = (t < N)[:, None] & (j < HALF)[None, :]  # [T, J]
    m = tj[:, None, :] & (h < H)[None, :, None]  # [T, H, J]
    xp = X + t64[:, None, None] * sxn + h[None, :, None] * sxh + j[None, None, :]
    x1 = tl.load(xp, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xp + HALF, mask=m, other=0.0).to(tl.float32)
    w1 = tl.load(W + j, mask=j < HALF, other=0.0).to(tl.float32)[None, None, :]
    w2 = tl.load(W + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, None, :]
    c = tl.load(COS + t64[:, None] * scn + j[None, :], mask=tj, other=0.0).to(tl.float32)
    s = tl.load(SIN + t64[:, None] * ssn + j[None, :], mask=tj, other=0.0).to(tl.float32)
    c, s = c[:, None, :], s[:, None, :]
    ms = (tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)) / (2 * HALF)
    rstd = (1.0 / tl.sqrt(ms + eps))[:, :, None]
    y1 = x1 * rstd * w1
    y2 = x2 * rstd * w2
    op = OUT + (t64[:, None, None] * H + h[None, :, None]) * (2 * HALF) + j[None, None, :]
    tl.store(op, rounded(y1 * c - y2 * s, OUT.dtype.element_ty), mask=m)
    tl.store(op + HALF, rounded(y2 * c + y1 * s, OUT.dtype.element_ty), mask=m)


@jit
def _qk_bwd(G, X, W, COS, SIN, DX, DC, DS, PW, N, sxn, sxh, sgn, sgh, scn, ssn, H, eps,
            HALF: tl.constexpr, WEIGHT_GRAD: tl.constexpr, ROPE_GRAD: tl.constexpr,
            BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    per = (N + P - 1) // P
    lo = pid * per
    hi = tl.minimum(lo + per, N)
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_J)
    jmask = j < HALF
    w1 = tl.load(W + j, mask=jmask, other=0.0).to(tl.float32)[None, None, :]
    w2 = tl.load(W + HALF + j, mask=jmask, other=0.0).to(tl.float32)[None, None, :]
    acc1 = tl.zeros([BLOCK_J], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_J], dtype=tl.float32)
    for i in range(lo, hi, BLOCK_T):
        t = i + tl.arange(0, BLOCK_T)
        t64 = t.to(tl.int64)
        tj = (t < hi)[:, None] & jmask[None, :]
        m = tj[:, None, :] & (h < H)[None, :, None]
        xp = X + t64[:, None, None] * sxn + h[None, :, None] * sxh + j[None, None, :]
        gp = G + t64[:, None, None] * sgn + h[None, :, None] * sgh + j[None, None, :]
        x1 = tl.load(xp, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(xp + HALF, mask=m, other=0.0).to(tl.float32)
        g1 = tl.load(gp, mask=m, other=0.0).to(tl.float32)
        g2 = tl.load(gp + HALF, mask=m, other=0.0).to(tl.float32)
        c = tl.load(COS + t64[:, None] * scn + j[None, :], mask=tj, other=0.0).to(tl.float32)
        s = tl.load(SIN + t64[:, None] * ssn + j[None, :], mask=tj, other=0.0).to(tl.float32)
        c, s = c[:, None, :], s[:, None, :]
        ms = (tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)) / (2 * HALF)
        rstd = (1.0 / tl.sqrt(ms + eps))[:, :, None]
        xh1 = x1 * rstd
        xh2 = x2 * rstd
        dy1 = g1 * c + g2 * s
        dy2 = g2 * c - g1 * s
        if WEIGHT_GRAD:
            acc1 += tl.sum(tl.sum(dy1 * xh1, axis=1), axis=0)
            acc2 += tl.sum(tl.sum(dy2 * xh2, axis=1), axis=0)
        gw1 = dy1 * w1
        gw2 = dy2 * w2
        k = ((tl.sum(gw1 * xh1, axis=2) + tl.sum(gw2 * xh2, axis=2)) / (2 * HALF))[:, :, None]
        dp = DX + (t64[:, None, None] * H + h[None, :, None]) * (2 * HALF) + j[None, None, :]
        tl.store(dp, rounded(rstd * (gw1 - xh1 * k), DX.dtype.element_ty), mask=m)
        tl.store(dp + HALF, rounded(rstd * (gw2 - xh2 * k), DX.dtype.element_ty), mask=m)
        if ROPE_GRAD:
            y1 = xh1 * w1
            y2 = xh2 * w2
            cp = t64[:, None] * HALF + j[None, :]
            dc = tl.sum(g1 * y1 + g2 * y2, axis=1)
            ds = tl.sum(g2 * y1 - g1 * y2, axis=1)
            tl.store(DC + cp, rounded(dc, DC.dtype.element_ty), mask=tj)
            tl.store(DS + cp, rounded(ds, DS.dtype.element_ty), mask=tj)
    if WEIGHT_GRAD:
        tl.store(PW + pid * (2 * HALF) + j, acc1, mask=jmask)
        tl.store(PW + pid * (2 * HALF) + HALF + j, acc2, mask=jmask)


def _tile(H: int, half: int) -> tuple[int, int, int, int]:
    """(tokens, heads, half-width) of a tile of about 4096 elements, and its warps."""
    bh, bj = pow2(H), pow2(half)
    bt = max(1, 4096 // (2 * bh * bj))
    return bt, bh, bj, row_warps(2 * bt * bh * bj)


def _qk_impl(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             eps: float) -> torch.Tensor:
    N, H, Dh = x.shape
    out = torch.empty((N, H, Dh), dtype=x.dtype, device=x.device)
    if N == 0 or H == 0:
        return out
    bt, bh, bj, nw = _tile(H, Dh // 2)
    _qk_fwd[(triton.cdiv(N, bt),)](x, weight, cos, sin, out, N, x.stride(0), x.stride(1),
                                   cos.stride(0), sin.stride(0), H, eps, HALF=Dh // 2,
                                   BLOCK_T=bt, BLOCK_H=bh, BLOCK_J=bj, num_warps=nw)
    return out


_qk_op = torch.library.custom_op("kohakumoss::triton_qk_norm_rope", _qk_impl, mutates_args=())


@_qk_op.register_fake
def _(x, weight, cos, sin, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _qk_bwd_impl(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, eps: float, weight_grad: bool, rope_grad: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw or [0], dcos and dsin or [0, Dh/2]). Without the weight's reduction every
    program takes one tile of tokens; with it, a few programs per SM walk their chunks."""
    N, H, Dh = x.shape
    g = lastdim_contiguous(g)
    dx = torch.empty((N, H, Dh), dtype=x.dtype, device=x.device)
    shape = (N, Dh // 2) if rope_grad else (1, 1)  # (1, 1): a valid pointer the kernel never uses
    dc = torch.empty(shape, dtype=cos.dtype, device=x.device)
    ds = torch.empty(shape, dtype=sin.dtype, device=x.device)
    bt, bh, bj, nw = _tile(H, Dh // 2)
    tiles = max(1, triton.cdiv(N, bt))
    P = max(1, min(programs(x.device), tiles)) if weight_grad else tiles
    pw = torch.zeros((P, Dh) if weight_grad else (1, 1), dtype=torch.float32, device=x.device)
    if N > 0 and H > 0:
        _qk_bwd[(P,)](g, x, weight, cos, sin, dx, dc, ds, pw, N, x.stride(0), x.stride(1),
                      g.stride(0), g.stride(1), cos.stride(0), sin.stride(0), H, eps,
                      HALF=Dh // 2, WEIGHT_GRAD=weight_grad, ROPE_GRAD=rope_grad, BLOCK_T=bt,
                      BLOCK_H=bh, BLOCK_J=bj, num_warps=nw)
    if not rope_grad:
        dc = torch.empty((0, Dh // 2), dtype=cos.dtype, device=x.device)
        ds = torch.empty((0, Dh // 2), dtype=sin.dtype, device=x.device)
    dw = pw.sum(0).to(weight.dtype) if weight_grad else torch.empty((0,), dtype=weight.dtype,
                                                                     device=x.device)
    return dx, dw, dc, ds


_qk_bwd_op = torch.library.custom_op("kohakumoss::triton_qk_norm_rope_bwd", _qk_bwd_impl,
                                     mutates_args=())


@_qk_bwd_op.register_fake
def _(g, x, weight, cos, sin, eps, weight_grad, rope_grad):
    N, _, Dh = x.shape
    shape = (N, Dh // 2) if rope_grad else (0, Dh // 2)
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(weight.shape if weight_grad else (0,), dtype=weight.dtype, device=x.device),
            torch.empty(shape, dtype=cos.dtype, device=x.device),
            torch.empty(shape, dtype=sin.dtype, device=x.device))


def _setup(ctx, inputs, output):
    x, weight, cos, sin, eps = inputs
    ctx.save_for_backward(x, weight, cos, sin)
    ctx.eps = eps


def _backward(ctx, g):
    x, weight, cos, sin = ctx.saved_tensors
    need = ctx.needs_input_grad
    rope_grad = need[2] or need[3]
    dx, dw, dc, ds = ctx.bwd(g, x, weight, cos, sin, ctx.eps, need[1], rope_grad)
    return dx, dw if need[1] else None, dc if need[2] else None, ds if need[3] else None, None


_qk = entry(_qk_op, _qk_impl, _setup, _backward, _qk_bwd_op, _qk_bwd_impl)


def qk_norm_rope(x_NHd: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """``ops.qk_norm_rope`` in Triton: x [N, H, Dh], weight [Dh], cos/sin [N, Dh/2]."""
    check_tensors("qk_norm_rope", x_NHd, weight, cos, sin)
    if x_NHd.dim() != 3 or x_NHd.shape[-1] % 2:
        raise ValueError(f"qk_norm_rope (triton): x {tuple(x_NHd.shape)}; want [N, H, Dh], Dh even")
    N, _, Dh = x_NHd.shape
    if weight.shape != (Dh,) or cos.shape != (N, Dh // 2) or sin.shape != (N, Dh // 2):
        raise ValueError(f"qk_norm_rope (triton): weight {tuple(weight.shape)}, cos "
                         f"{tuple(cos.shape)}, sin {tuple(sin.shape)} for x {tuple(x_NHd.shape)}; "
                         f"want [{Dh}], [{N}, {Dh // 2}], [{N}, {Dh // 2}]")
    return _qk(lastdim_contiguous(x_NHd), lastdim_contiguous(weight), lastdim_contiguous(cos),
               lastdim_contiguous(sin), float(eps))
