"""Triton helpers of fp8 compute (``fp8_compute.py``): the row-wise e4m3 quantization of
activations and the transpose of weight codes.

- ``fp8_rows`` / ``fp8_rows_joined``: each row's amax, scale ``amax / 448``, and the row in
  float8_e4m3fn (each column first times its own factor where one is given: fp8 compute's
  input gradient); joined, one to three sources quantized as one row;
- ``transposed_codes``: [N, K] codes transposed side by side into [K, sum of N], the layout
  the input-gradient GEMM wants.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kohakumoss.kernels.triton_common import INTERPRETED, check_tensors, jit

_INTERPRETED = tl.constexpr(INTERPRETED)


@jit
def _to_e4m3(x):
    """fp32 -> float8_e4m3fn, nearest-even. Interpreted, the rounding is done first (3
    mantissa bits kept on the bits, the carry into the exponent included; subnormals on their
    grid): the interpreter's cast drops that carry (124.7 became 64, not 128) and truncates
    subnormals."""
    if _INTERPRETED:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
        # below 2^-6 e4m3 is subnormal, a grid of 2^-9: nearest-even by the 1.5 * 2^23 trick
        sub = (x * 512.0 + 12582912.0) - 12582912.0
        x = tl.where(tl.abs(x) < 0.015625, sub * 0.001953125, bits.to(tl.float32, bitcast=True))
    return x.to(tl.float8e4nv)


@jit
def _row_source(j: tl.constexpr, X0, X1, X2):
    if j == 0:
        return X0
    elif j == 1:
        return X1
    else:
        return X2


@jit
def _row_part(X, CS, j: tl.constexpr, k0, K, cols, COLS: tl.constexpr):
    """Columns ``k0 + cols`` of source ``j``'s row (X points at it), times their factors."""
    m = (k0 + cols) < K
    x = tl.load(X + k0 + cols, mask=m, other=0.0).to(tl.float32)
    if COLS:
        x = x * tl.load(CS + j * K + k0 + cols, mask=m, other=0.0)
    return x


@jit
def _fp8_rows(X0, X1, X2, CS, Q, S, K, sx0, sx1, sx2, NSRC: tl.constexpr, COLS: tl.constexpr,
              BLOCK: tl.constexpr):
    """Row ``row`` of [X0 | X1 | X2][:, :NSRC * K] (each source K wide, its own row stride)
    as e4m3 codes under one scale, into a row of Q (NSRC * K wide). A source that fits one
    block (``K <= BLOCK``) is read once and held in registers; a wider one is read twice."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    out = Q + row * (NSRC * K)
    if K <= BLOCK:
        x0 = _row_part(X0 + row * sx0, CS, 0, 0, K, cols, COLS)
        amax = tl.abs(x0)
        if NSRC > 1:
            x1 = _row_part(X1 + row * sx1, CS, 1, 0, K, cols, COLS)
            amax = tl.maximum(amax, tl.abs(x1))
        if NSRC > 2:
            x2 = _row_part(X2 + row * sx2, CS, 2, 0, K, cols, COLS)
            amax = tl.maximum(amax, tl.abs(x2))
        s = tl.max(amax, axis=0) / 448.0
        s = tl.where(s > 0.0, s, 1.0)
        m = cols < K
        tl.store(out + cols, _to_e4m3(tl.minimum(tl.maximum(x0 / s, -448.0), 448.0)), mask=m)
        if NSRC > 1:
            tl.store(out + K + cols, _to_e4m3(tl.minimum(tl.maximum(x1 / s, -448.0), 448.0)), mask=m)
        if NSRC > 2:
            tl.store(out + 2 * K + cols, _to_e4m3(tl.minimum(tl.maximum(x2 / s, -448.0), 448.0)), mask=m)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(NSRC):
            X = _row_source(j, X0, X1, X2) + row * _row_source(j, sx0, sx1, sx2)
            for k0 in range(0, K, BLOCK):
                amax = tl.maximum(amax, tl.abs(_row_part(X, CS, j, k0, K, cols, COLS)))
        s = tl.max(amax, axis=0) / 448.0
        s = tl.where(s > 0.0, s, 1.0)
        for j in tl.static_range(NSRC):
            X = _row_source(j, X0, X1, X2) + row * _row_source(j, sx0, sx1, sx2)
            for k0 in range(0, K, BLOCK):
                q = tl.minimum(tl.maximum(_row_part(X, CS, j, k0, K, cols, COLS) / s, -448.0), 448.0)
                tl.store(out + j * K + k0 + cols, _to_e4m3(q), mask=(k0 + cols) < K)
    tl.store(S + row, s)


@jit
def _transpose(A, B, N, K, sb, BN: tl.constexpr, BK: tl.constexpr):
    """``B[k, n] = A[n, k]``: A [N, K] contiguous, B's rows ``sb`` apart (bytes as uint8)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    m = (rn[:, None] < N) & (rk[None, :] < K)
    a = tl.load(A + rn.to(tl.int64)[:, None] * K + rk[None, :], mask=m, other=0)
    tl.store(B + rk.to(tl.int64)[:, None] * sb + rn[None, :], tl.trans(a), mask=tl.trans(m))



def fp8_rows(x: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.fp8_rows`` in Triton: one program per row (amax, then the codes); with
    ``col_scale`` [K] (fp32) the rows of ``x * col_scale`` (the product in fp32)."""
    return fp8_rows_joined([x], col_scale)


def fp8_rows_joined(xs: list[torch.Tensor], col_scale: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.fp8_rows(torch.cat(xs, 1), col_scale)`` without the concatenation: one to three
    [M, K] sources (rows contiguous, any row stride), each row quantized under one scale
    across all of them (fp8 compute's input gradient of q, k and v: one GEMM)."""
    if not 1 <= len(xs) <= 3 or any(x.shape != xs[0].shape or x.dim() != 2 for x in xs):
        raise ValueError(f"fp8_rows: one to three 2-D sources of one shape, got "
                         f"{[tuple(x.shape) for x in xs]}")
    xs = [x if x.stride(-1) == 1 else x.contiguous() for x in xs]
    check_tensors("fp8_rows", *xs)
    (M, K), n = xs[0].shape, len(xs)
    q = torch.empty((M, n * K), dtype=torch.float8_e4m3fn, device=xs[0].device)
    s = torch.empty((M,), dtype=torch.float32, device=xs[0].device)
    if M and K:
        # a row up to 4096 wide per source is held in registers (read once); interpreted,
        # rows up to 32 wide take that path and wider ones the two-pass loop over 16
        wide = 32 if INTERPRETED else 4096
        block = triton.next_power_of_2(K) if K <= wide else (16 if INTERPRETED else 2048)
        cs = xs[0] if col_scale is None else col_scale.float().contiguous()
        src = [*xs, xs[0], xs[0]][:3]
        _fp8_rows[(M,)](*src, cs, q, s, K, *(x.stride(0) for x in src), NSRC=n,
                        COLS=col_scale is not None, BLOCK=block, num_warps=8 if K * n > 4096 else 4)
    return q, s


def transposed_codes(codes: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat([c.t() for c in codes], 1).contiguous()``: [K, sum of N], each [N, K]
    code matrix's transpose side by side, by a tiled kernel on the bytes (torch's own copy
    of a one-byte transpose runs at a fraction of the memory's speed)."""
    K = codes[0].shape[1]
    if any(c.dim() != 2 or c.shape[1] != K or c.dtype != codes[0].dtype for c in codes):
        raise ValueError("transposed_codes: [N, K] codes of one K and dtype")
    total = sum(c.shape[0] for c in codes)
    out = torch.empty((K, total), dtype=codes[0].dtype, device=codes[0].device)
    bn, bk = (16, 16) if INTERPRETED else (64, 64)
    col = 0
    for c in codes:
        N = c.shape[0]
        if N and K:
            a = c.contiguous().view(torch.uint8)
            _transpose[(triton.cdiv(N, bn), triton.cdiv(K, bk))](
                a, out.view(torch.uint8)[:, col:], N, K, total, BN=bn, BK=bk, num_warps=4)
        col += N
    return out
