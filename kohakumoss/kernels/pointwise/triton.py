"""Triton SiTU, residual add and gated residual add (``model/ops.py``: ``situ``,
``residual``, ``gated_residual``), forward and backward, as ``torch.library`` custom ops.

Math, all in fp32, rounded once to the output's dtype (the first input's):
- SiTU: ``A(g) = 4 tanh(g/4) sigmoid(g)``, ``U(u) = 25 tanh(u/25)``, ``out = A U``;
  ``du = go A (1 - tanh(u/25)^2)``,
  ``dg = go U ((1 - tanh(g/4)^2) sig + 4 tanh(g/4) sig (1 - sig))`` with ``sig = sigmoid(g)``.
  Both tanh and the sigmoid of g come from one ``exp2`` and one division (``situ_gate``
  forward, ``gate_parts`` backward), tanh(u/25) from another: the special-function unit,
  not memory, bounds this kernel.
- residual: ``out = x + y``; its gradients are the output's, cast to each input's dtype.
- gated residual: ``out = x + gate[seg] y``; ``dx = go``, ``dy = gate[seg] go``,
  ``dgate_b = sum_{rows of b} go y`` (per (sample, chunk) program in fp32 registers, then a
  fixed-order sum of the chunks' partials).

Legend: R rows, C columns, B samples, K chunks per sample.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kohakumoss.kernels.custom import entry, gated_residual_setup, packed_halves, rows2d
from kohakumoss.kernels.triton_common import (check_tensors, gate_parts, jit, pow2, programs,
                                              rounded, segment_order, situ_gate, tanh_nonneg,
                                              warps)

_TILE, _BLOCK_C = 4096, 1024  # the elementwise tile: elements, widest column block


@jit
def _situ_fwd(U, G, OUT, R, C, su, sg, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    m = (rows < R) & (cols < C)
    u = tl.load(U + rows * su + cols, mask=m, other=0.0).to(tl.float32)
    g = tl.load(G + rows * sg + cols, mask=m, other=0.0).to(tl.float32)
    gate = situ_gate(g)  # 4 tanh(g/4) sigmoid(g)
    tu = tanh_nonneg(tl.abs(u) * 0.04)
    value = 25.0 * tl.where(u < 0.0, -tu, tu)  # 25 tanh(u/25)
    tl.store(OUT + rows * C + cols, rounded(gate * value, OUT.dtype.element_ty), mask=m)


@jit
def _situ_bwd(GO, U, G, DU, DG, R, C, sgo, su, sg, sd, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    m = (rows < R) & (cols < C)
    go = tl.load(GO + rows * sgo + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + rows * su + cols, mask=m, other=0.0).to(tl.float32)
    g = tl.load(G + rows * sg + cols, mask=m, other=0.0).to(tl.float32)
    t4, sp, a2 = gate_parts(g)
    pos = g >= 0.0
    sig = tl.where(pos, sp, a2 * sp)  # sigmoid(g)
    tg = tl.where(pos, t4, -t4)  # tanh(g/4)
    tu = tanh_nonneg(tl.abs(u) * 0.04)
    tu = tl.where(u < 0.0, -tu, tu)  # tanh(u/25)
    # d/dg 4 tanh(g/4) sigmoid(g) = (1 - tanh^2) sigmoid + 4 tanh sigmoid (1 - sigmoid),
    # and sigmoid(g) (1 - sigmoid(g)) = e^-|g| sigmoid(|g|)^2 on either side of 0
    dgate = (1.0 - t4 * t4) * sig + 4.0 * tg * (a2 * sp * sp)
    du = go * (4.0 * tg * sig) * (1.0 - tu * tu)
    dg = go * (25.0 * tu) * dgate
    tl.store(DU + rows * sd + cols, rounded(du, DU.dtype.element_ty), mask=m)
    tl.store(DG + rows * sd + cols, rounded(dg, DG.dtype.element_ty), mask=m)


@jit
def _add_fwd(X, Y, GATE, SEG, OUT, R, C, sx, sy, s_gate,
             GATED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rows = r.to(tl.int64)[:, None]
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    m = (rows < R) & (cols < C)
    x = tl.load(X + rows * sx + cols, mask=m, other=0.0).to(tl.float32)
    y = tl.load(Y + rows * sy + cols, mask=m, other=0.0).to(tl.float32)
    if GATED:
        s = tl.load(SEG + r, mask=r < R, other=0).to(tl.int64)[:, None]
        y = tl.load(GATE + s * s_gate + cols, mask=m, other=0.0).to(tl.float32) * y
    tl.store(OUT + rows * C + cols, rounded(x + y, OUT.dtype.element_ty), mask=m)


@jit
def _gated_bwd(GO, Y, GATE, ORDER, STARTS, DY, PGATE, C, sgo, sy, s_gate, K,
               GATE_GRAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // K
    k = pid % K
    start = tl.load(STARTS + b)
    end = tl.load(STARTS + b + 1)
    per = (end - start + K - 1) // K
    lo = start + k * per
    hi = tl.minimum(lo + per, end)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    gate = tl.load(GATE + b.to(tl.int64) * s_gate + cols, mask=cmask, other=0.0)
    gate = gate.to(tl.float32)[None, :]
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for i in range(lo, hi, BLOCK_R):
        idx = i + tl.arange(0, BLOCK_R)
        rmask = idx < hi
        rows = tl.load(ORDER + idx, mask=rmask, other=0).to(tl.int64)[:, None]
        m = rmask[:, None] & cmask[None, :]
        go = tl.load(GO + rows * sgo + cols[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(DY + rows * C + cols[None, :], rounded(gate * go, DY.dtype.element_ty), mask=m)
        if GATE_GRAD:
            y = tl.load(Y + rows * sy + cols[None, :], mask=m, other=0.0).to(tl.float32)
            acc += tl.sum(go * y, axis=0)
    if GATE_GRAD:
        tl.store(PGATE + pid * C + cols, acc, mask=cmask)


def _grid(R: int, C: int, tile: int = _TILE, widest: int = _BLOCK_C) -> tuple[tuple[int, int], int, int]:
    block_c = min(widest, pow2(C))
    block_r = max(1, min(64, tile // block_c))
    return (triton.cdiv(R, block_r), triton.cdiv(C, block_c)), block_r, block_c


def _situ_grid(R: int, C: int) -> tuple[tuple[int, int], int, int]:
    """SiTU's tiles: 2048 elements, one row of 2048 columns at the FFN's width. Measured on
    the H200 at [8318, 8192] (the column halves of [8318, 16384]): 0.160 ms forward and
    0.208 ms backward, against 0.179 and 0.287 ms with the 4 x 1024 tiles of the other ops."""
    return _grid(R, C, tile=2048, widest=2048)


def _check_pair(op: str, a: torch.Tensor, b: torch.Tensor, names: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{op} (triton): {names} of shapes {tuple(a.shape)} and {tuple(b.shape)}; "
                         f"the kernel takes equal shapes (no broadcasting)")


# ---- SiTU ----------------------------------------------------------------------------------

def _situ_impl(u: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    R, C = u.shape
    out = torch.empty((R, C), dtype=u.dtype, device=u.device)
    if out.numel():
        grid, br, bc = _situ_grid(R, C)
        _situ_fwd[grid](u, g, out, R, C, u.stride(0), g.stride(0), BLOCK_R=br, BLOCK_C=bc,
                        num_warps=warps(br * bc))
    return out


_situ_op = torch.library.custom_op("kohakumoss::triton_situ", _situ_impl, mutates_args=())


@_situ_op.register_fake
def _(u, g):
    return torch.empty(u.shape, dtype=u.dtype, device=u.device)


def _situ_bwd_impl(go: torch.Tensor, u: torch.Tensor, g: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    R, C = u.shape
    go = rows2d(go, C)
    du = torch.empty((R, C), dtype=u.dtype, device=u.device)
    dg = torch.empty((R, C), dtype=g.dtype, device=g.device)
    if du.numel():
        grid, br, bc = _situ_grid(R, C)
        _situ_bwd[grid](go, u, g, du, dg, R, C, go.stride(0), u.stride(0), g.stride(0), C,
                        BLOCK_R=br, BLOCK_C=bc, num_warps=warps(br * bc))
    return du, dg


_situ_bwd_op = torch.library.custom_op("kohakumoss::triton_situ_bwd", _situ_bwd_impl,
                                       mutates_args=())


@_situ_bwd_op.register_fake
def _(go, u, g):
    return (torch.empty(u.shape, dtype=u.dtype, device=u.device),
            torch.empty(g.shape, dtype=g.dtype, device=g.device))


def _situ_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _situ_backward(ctx, go):
    u, g = ctx.saved_tensors
    return ctx.bwd(go, u, g)


_situ = entry(_situ_op, _situ_impl, _situ_setup, _situ_backward, _situ_bwd_op, _situ_bwd_impl)


# The packed form: u and g are the column halves of one [R, 2C] tensor (the fused up-gate
# projection's output), read in place; backward writes their gradients as one [R, 2C]
# tensor, so autograd skips the split's backward (a concatenation of 2C columns per token).

def _situ_packed_impl(ug: torch.Tensor) -> torch.Tensor:
    C = ug.shape[1] // 2
    return _situ_impl(ug[:, :C], ug[:, C:])


_situ_packed_op = torch.library.custom_op("kohakumoss::triton_situ_packed", _situ_packed_impl,
                                          mutates_args=())


@_situ_packed_op.register_fake
def _(ug):
    return torch.empty((ug.shape[0], ug.shape[1] // 2), dtype=ug.dtype, device=ug.device)


def _situ_packed_bwd_impl(go: torch.Tensor, ug: torch.Tensor) -> torch.Tensor:
    R, C2 = ug.shape
    C = C2 // 2
    go = rows2d(go, C)
    d = torch.empty((R, C2), dtype=ug.dtype, device=ug.device)
    if d.numel():
        grid, br, bc = _situ_grid(R, C)
        _situ_bwd[grid](go, ug, ug[:, C:], d, d[:, C:], R, C, go.stride(0), ug.stride(0),
                        ug.stride(0), C2, BLOCK_R=br, BLOCK_C=bc, num_warps=warps(br * bc))
    return d


_situ_packed_bwd_op = torch.library.custom_op("kohakumoss::triton_situ_packed_bwd",
                                              _situ_packed_bwd_impl, mutates_args=())


@_situ_packed_bwd_op.register_fake
def _(go, ug):
    return torch.empty(ug.shape, dtype=ug.dtype, device=ug.device)


def _situ_packed_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _situ_packed_backward(ctx, go):
    ug, = ctx.saved_tensors
    return ctx.bwd(go, ug)


_situ_packed = entry(_situ_packed_op, _situ_packed_impl, _situ_packed_setup, _situ_packed_backward,
                     _situ_packed_bwd_op, _situ_packed_bwd_impl)


def situ(u: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``ops.situ`` in Triton: u and g of one shape (column-strided views taken as they are).
    When they are the two halves of one tensor (``packed_halves``) the kernel takes that
    tensor, and its gradient is written whole."""
    check_tensors("situ", u, g)
    _check_pair("situ", u, g, "u and g")
    C = u.shape[-1] if u.dim() else 1
    ug = packed_halves(u, g)
    if ug is not None:
        return _situ_packed(rows2d(ug, 2 * C)).view(u.shape)
    return _situ(rows2d(u, C), rows2d(g, C)).view(u.shape)


# ---- residual and gated residual -----------------------------------------------------------

def _residual_impl(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    R, C = x.shape
    out = torch.empty((R, C), dtype=x.dtype, device=x.device)
    if out.numel():
        grid, br, bc = _grid(R, C)
        _add_fwd[grid](x, y, x, x, out, R, C, x.stride(0), y.stride(0), 0,
                       GATED=False, BLOCK_R=br, BLOCK_C=bc, num_warps=warps(br * bc))
    return out


_residual_op = torch.library.custom_op("kohakumoss::triton_residual", _residual_impl,
                                       mutates_args=())


@_residual_op.register_fake
def _(x, y):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _residual_setup(ctx, inputs, output):
    ctx.dtypes = (inputs[0].dtype, inputs[1].dtype)


def _residual_backward(ctx, go):
    # d(x + y) = go; the reference's fp32 upcast of go and the cast back to each input's
    # dtype are exact, so the gradients are go itself, in each input's dtype
    return go.to(ctx.dtypes[0]), go.to(ctx.dtypes[1])


_residual = entry(_residual_op, _residual_impl, _residual_setup, _residual_backward)


def residual(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``ops.residual`` in Triton: ``x + y`` in fp32, rounded once to x's dtype."""
    check_tensors("residual", x, y)
    _check_pair("residual", x, y, "x and y")
    C = x.shape[-1] if x.dim() else 1
    return _residual(rows2d(x, C), rows2d(y, C)).view(x.shape)


def _gated_impl(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, seg: torch.Tensor
                ) -> torch.Tensor:
    R, C = x.shape
    out = torch.empty((R, C), dtype=x.dtype, device=x.device)
    if out.numel():
        grid, br, bc = _grid(R, C)
        _add_fwd[grid](x, y, gate, seg, out, R, C, x.stride(0), y.stride(0), gate.stride(0),
                       GATED=True, BLOCK_R=br, BLOCK_C=bc, num_warps=warps(br * bc))
    return out


_gated_op = torch.library.custom_op("kohakumoss::triton_gated_residual", _gated_impl,
                                    mutates_args=())


@_gated_op.register_fake
def _(x, y, gate, seg):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _gated_bwd_impl(go: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, seg: torch.Tensor,
                  gate_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    R, C = y.shape
    B = gate.shape[0]
    go = rows2d(go, C)
    K = max(1, -(-programs(y.device) // B))
    dy = torch.empty((R, C), dtype=y.dtype, device=y.device)
    pgate = torch.zeros((B * K, C) if gate_grad else (1, 1), dtype=torch.float32, device=y.device)
    if dy.numel():
        order, starts = segment_order(seg, B)
        block_c = min(256, pow2(C))
        block_r = max(1, _TILE // 2 // block_c)
        _gated_bwd[(B * K, triton.cdiv(C, block_c))](
            go, y, gate, order, starts, dy, pgate, C, go.stride(0), y.stride(0), gate.stride(0), K,
            GATE_GRAD=gate_grad, BLOCK_R=block_r, BLOCK_C=block_c,
            num_warps=warps(block_r * block_c))
    if not gate_grad:  # an empty [0, C] answer (the kernel had a one-element dummy)
        return dy, torch.zeros((0, C), dtype=torch.float32, device=y.device)
    return dy, pgate.view(B, K, C).sum(1)


_gated_bwd_op = torch.library.custom_op("kohakumoss::triton_gated_residual_bwd", _gated_bwd_impl,
                                        mutates_args=())


@_gated_bwd_op.register_fake
def _(go, y, gate, seg, gate_grad):
    shape = gate.shape if gate_grad else (0, y.shape[1])
    return (torch.empty(y.shape, dtype=y.dtype, device=y.device),
            torch.empty(shape, dtype=torch.float32, device=y.device))


def _gated_backward(ctx, go):
    y, gate, seg = ctx.saved_tensors  # y: None where the gate takes no gradient
    gate_grad = ctx.needs_input_grad[2]
    dy, dgate = ctx.bwd(go, rows2d(go, go.shape[-1]) if y is None else y, gate, seg, gate_grad)
    return go.to(ctx.x_dtype), dy.to(ctx.y_dtype), dgate.to(gate.dtype) if gate_grad else None, None


_gated = entry(_gated_op, _gated_impl, gated_residual_setup, _gated_backward, _gated_bwd_op,
               _gated_bwd_impl)


def gated_residual(x_ND: torch.Tensor, y_ND: torch.Tensor, gate_BD: torch.Tensor,
                   seg_N: torch.Tensor) -> torch.Tensor:
    """``ops.gated_residual`` in Triton: ``x + gate[seg] y``; ``seg_N`` values lie in [0, B)."""
    check_tensors("gated_residual", x_ND, y_ND, gate_BD)
    _check_pair("gated_residual", x_ND, y_ND, "x and y")
    N, D = x_ND.shape
    if gate_BD.dim() != 2 or gate_BD.shape[1] != D or seg_N.shape != (N,):
        raise ValueError(f"gated_residual (triton): x {tuple(x_ND.shape)}, gate "
                         f"{tuple(gate_BD.shape)}, seg {tuple(seg_N.shape)}; "
                         f"want [N, D], [B, D], [N]")
    return _gated(rows2d(x_ND, D), rows2d(y_ND, D), rows2d(gate_BD, D), seg_N)
