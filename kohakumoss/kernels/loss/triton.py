"""Triton flow loss (``diffusion/objective.py``: ``flow_loss``), forward and backward, as
``torch.library`` custom ops.

Math, all in fp32: ``d = pred - target`` per element, the error ``e(d)`` (mse ``d^2``, l1
``|d|``, huber ``0.5 d^2`` for ``|d| <= delta`` else ``delta (|d| - 0.5 delta)``), its mean
over the C channels of a token, times the token's sample weight ``w[seg]``; each program sums
its rows into one fp32 partial, and the partials are summed in a fixed order and divided by
the step's token count (``n``): deterministic, one pass over pred and target.

Backward (``pred`` only: the target and the weights are data): ``dpred = go w[seg] e'(d) /
(C n)`` with ``e'`` = ``2 d``, ``sign(d)``, or ``clamp(d, -delta, delta)``, rounded once to
pred's dtype. The incoming gradient is read from device memory (no host sync).

Legend: R tokens (rows), C channels, B samples.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kohakumoss.kernels.custom import entry
from kohakumoss.kernels.triton_common import check_tensors, jit, pow2, rounded, warps
from kohakumoss.diffusion.objective import LOSSES

_TILE = 4096  # elements per program


@jit
def _tile(P, T, SEG, W, R, C, sp, st, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's rows: (rows, columns, element mask, row mask, ``pred - target`` in
    fp32, each row's sample weight)."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)[None, :]
    rmask = rows < R
    m = rmask[:, None] & (cols < C)
    d = tl.load(P + rows[:, None] * sp + cols, mask=m, other=0.0).to(tl.float32) \
        - tl.load(T + rows[:, None] * st + cols, mask=m, other=0.0).to(tl.float32)
    seg = tl.load(SEG + rows, mask=rmask, other=0)
    w = tl.load(W + seg, mask=rmask, other=0.0).to(tl.float32)
    return rows, cols, m, rmask, d, w


@jit
def _loss_fwd(P, T, SEG, W, PART, R, C, sp, st, delta, KIND: tl.constexpr,
              BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows, cols, m, rmask, d, w = _tile(P, T, SEG, W, R, C, sp, st, BLOCK_R, BLOCK_C)
    if KIND == 0:
        e = d * d
    elif KIND == 1:
        e = tl.abs(d)
    else:
        a = tl.abs(d)
        e = tl.where(a <= delta, 0.5 * d * d, delta * (a - 0.5 * delta))
    e = tl.where(m, e, 0.0)
    per_row = tl.sum(e, axis=1) / C * w
    tl.store(PART + tl.program_id(0), tl.sum(tl.where(rmask, per_row, 0.0), axis=0))


@jit
def _loss_bwd(GO, P, T, SEG, W, DP, R, C, sp, st, delta, inv_n, KIND: tl.constexpr,
              BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows, cols, m, _, d, w = _tile(P, T, SEG, W, R, C, sp, st, BLOCK_R, BLOCK_C)
    if KIND == 0:
        de = 2.0 * d
    elif KIND == 1:
        de = tl.where(d > 0.0, 1.0, tl.where(d < 0.0, -1.0, 0.0))
    else:
        de = tl.minimum(tl.maximum(d, -delta), delta)
    go = tl.load(GO).to(tl.float32)
    scale = (go * inv_n / C) * w
    tl.store(DP + rows[:, None] * C + cols, rounded(de * scale[:, None], DP.dtype.element_ty), mask=m)


def _blocks(R: int, C: int) -> tuple[int, int, int]:
    bc = pow2(C)
    br = max(1, min(pow2(R), _TILE // bc))
    return triton.cdiv(R, br), br, bc


def _kind(loss: str) -> int:
    if loss not in LOSSES:
        raise ValueError(f"flow_loss (triton): unknown loss {loss!r}; one of {', '.join(LOSSES)}")
    return LOSSES.index(loss)


def _fwd_impl(pred: torch.Tensor, target: torch.Tensor, seg: torch.Tensor, weight: torch.Tensor,
              n_tokens: int, loss: str, delta: float) -> torch.Tensor:
    R, C = pred.shape
    if R == 0:
        return pred.new_zeros((), dtype=torch.float32)
    programs, br, bc = _blocks(R, C)
    part = torch.empty(programs, dtype=torch.float32, device=pred.device)
    _loss_fwd[(programs,)](pred, target, seg, weight, part, R, C, pred.stride(0), target.stride(0),
                           float(delta), KIND=_kind(loss), BLOCK_R=br, BLOCK_C=bc,
                           num_warps=warps(br * bc))
    return part.sum() / max(1, n_tokens)


_fwd_op = torch.library.custom_op("kohakumoss::triton_flow_loss", _fwd_impl, mutates_args=())


@_fwd_op.register_fake
def _(pred, target, seg, weight, n_tokens, loss, delta):
    return pred.new_empty((), dtype=torch.float32)


def _bwd_impl(go: torch.Tensor, pred: torch.Tensor, target: torch.Tensor, seg: torch.Tensor,
              weight: torch.Tensor, n_tokens: int, loss: str, delta: float) -> torch.Tensor:
    R, C = pred.shape
    dp = torch.empty((R, C), dtype=pred.dtype, device=pred.device)
    if R:
        programs, br, bc = _blocks(R, C)
        _loss_bwd[(programs,)](go, pred, target, seg, weight, dp, R, C, pred.stride(0),
                               target.stride(0), float(delta), 1.0 / max(1, n_tokens),
                               KIND=_kind(loss), BLOCK_R=br, BLOCK_C=bc, num_warps=warps(br * bc))
    return dp


_bwd_op = torch.library.custom_op("kohakumoss::triton_flow_loss_bwd", _bwd_impl, mutates_args=())


@_bwd_op.register_fake
def _(go, pred, target, seg, weight, n_tokens, loss, delta):
    return torch.empty(pred.shape, dtype=pred.dtype, device=pred.device)


def _setup(ctx, inputs, output):
    pred, target, seg, weight, n_tokens, loss, delta = inputs
    ctx.save_for_backward(pred, target, seg, weight)
    ctx.static = (n_tokens, loss, delta)


def _backward(ctx, go):
    pred, target, seg, weight = ctx.saved_tensors
    return (ctx.bwd(go.reshape(1), pred, target, seg, weight, *ctx.static),
            None, None, None, None, None, None)


_flow_loss = entry(_fwd_op, _fwd_impl, _setup, _backward, _bwd_op, _bwd_impl)


def flow_loss(pred_NC: torch.Tensor, target_NC: torch.Tensor, seg_N: torch.Tensor,
              weight_B: torch.Tensor, n_tokens: int, loss: str = "mse", delta: float = 1.0
              ) -> torch.Tensor:
    """``ops.flow_loss`` in Triton: pred [N, C] (any float dtype the kernels take, rows
    strided as they are), target [N, C], seg [N] int64, weight [B]; the gradient reaches
    pred only (the target and weights are data, as in training)."""
    check_tensors("flow_loss", pred_NC, target_NC, weight_B)
    if pred_NC.dim() != 2 or target_NC.shape != pred_NC.shape or seg_N.shape != pred_NC.shape[:1]:
        raise ValueError(f"flow_loss (triton): pred {tuple(pred_NC.shape)}, target "
                         f"{tuple(target_NC.shape)}, seg {tuple(seg_N.shape)}; want [N, C], "
                         f"[N, C], [N]")
    if target_NC.requires_grad or weight_B.requires_grad:
        raise ValueError("flow_loss (triton): the target and weights are data (no gradient); "
                         "use the reference for a loss that differentiates them")
    pred, target = (t if t.stride(-1) == 1 else t.contiguous() for t in (pred_NC, target_NC))
    return _flow_loss(pred, target, seg_N.long(), weight_B.float(), int(n_tokens), loss, float(delta))
