"""Triton linears over a quantized frozen weight (``model/ops.py``: ``quant_linear``,
``fp8_linear``'s input gradient, and the row-wise fp8 quantization of activations).

The weight stays quantized in memory: ``codes`` [N, K] int8 or float8_e4m3fn with one
float32 ``scale`` per output row. The fused kernels (``quant_linear``) load a tile of codes
and widen it in registers, writing no dequantized copy of the weight; ``dequant_linear``
(the ``dequant_mm`` backend, many rows) writes one layer's weight into a transient buffer
for cuBLAS instead, and ``dequantize`` is that pass alone.

- forward ``y = x W^T``: ``acc[m, n] = sum_k x[m, k] codes[n, k]`` on the tensor cores (a code
  is exact in bf16 and fp16: int8 has 8 significant bits, e4m3 has 4), then
  ``y = acc * scale[n] (+ bias[n])`` in fp32, rounded once. The scale is constant along the
  sum, so it is applied once, after it: one rounding fewer than a dequantized bf16 weight;
- input gradient ``dx = dy W``: the sum runs over the rows ``n`` the scales belong to, so
  each tile is dequantized in registers, ``(codes[n, k] * scale[n])`` rounded to dy's dtype
  (the weight a bf16 model would hold), then multiplied on the tensor cores;
- ``fp8_rows``: each row's amax, scale ``amax / 448``, and the row in float8_e4m3fn (each
  column first times its own factor where one is given: fp8 compute's input gradient).

fp32 inputs are multiplied in full fp32 (``input_precision="ieee"``), not TF32. Compiled,
each kernel is autotuned per (token bucket, N, K); interpreted (``TRITON_INTERPRET=1``, the
CPU tests) one small tile is used.

Legend: M rows (tokens), N output features, K input features.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kohakumoss.kernels.triton_common import INTERPRETED, check_tensors, entry, jit, rounded

CODES = (torch.int8, torch.float8_e4m3fn)
_INTERPRETED = tl.constexpr(INTERPRETED)


@jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b`` with fp32 sums; fp32 operands in full fp32. Interpreted, half-precision
    operands are widened first (the interpreter's own half-precision dot is wrong; the
    products of bf16/fp16 values are exact in fp32, as on the tensor cores)."""
    if IEEE or _INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@jit
def _swizzle(pid, grid_a, grid_b, GROUP: tl.constexpr):
    """Program ``pid`` -> (tile along a, tile along b), ``GROUP`` a-tiles walked together so
    the b-tiles they share stay in L2."""
    width = GROUP * grid_b
    first = (pid // width) * GROUP
    size = tl.minimum(grid_a - first, GROUP)
    return first + (pid % width) % size, (pid % width) // size


@jit
def _qmm_fwd(X, Q, S, BIAS, OUT, M, N, K, MB, sx, sq, so, HAS_BIAS: tl.constexpr,
             IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             GROUP: tl.constexpr):
    pid_m, pid_n = _swizzle(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    xp = X + rm.to(tl.int64)[:, None] * sx + rk[None, :]
    qp = Q + rn.to(tl.int64)[None, :] * sq + rk[:, None]  # a [BK, BN] tile of codes^T
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        km = (k0 + rk) < K
        a = tl.load(xp, mask=(rm[:, None] < M) & km[None, :], other=0.0)
        bm = km[:, None] & (rn[None, :] < N)  # fp8 loads take no `other`: zeroed after
        b = tl.where(bm, tl.load(qp, mask=bm).to(tl.float32), 0.0).to(a.dtype)
        acc = _mma(a, b, acc, IEEE)
        xp += BK
        qp += BK
    acc = acc * tl.load(S + rn, mask=rn < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out = OUT + rm.to(tl.int64)[:, None] * so + rn[None, :]
    tl.store(out, rounded(acc, OUT.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@jit
def _qmm_bwd(DY, Q, S, DX, M, N, K, MB, sd, sq, sx, IEEE: tl.constexpr, BM: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    # dx [M, K] = dy [M, N] @ (codes * scale) [N, K]; BK tiles the output, BN the sum
    pid_m, pid_k = _swizzle(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(K, BK), GROUP)
    rm = pid_m * BM + tl.arange(0, BM)
    rk = pid_k * BK + tl.arange(0, BK)
    rn = tl.arange(0, BN)
    dp = DY + rm.to(tl.int64)[:, None] * sd + rn[None, :]
    qp = Q + rn.to(tl.int64)[:, None] * sq + rk[None, :]
    acc = tl.zeros((BM, BK), dtype=tl.float32)
    for n0 in range(0, N, BN):
        nm = (n0 + rn) < N
        a = tl.load(dp, mask=(rm[:, None] < M) & nm[None, :], other=0.0)
        s = tl.load(S + n0 + rn, mask=nm, other=0.0)
        bm = nm[:, None] & (rk[None, :] < K)
        b = tl.where(bm, tl.load(qp, mask=bm).to(tl.float32), 0.0)
        acc = _mma(a, rounded(b * s[:, None], a.dtype), acc, IEEE)
        dp += BN
        qp += BN * sq
    out = DX + rm.to(tl.int64)[:, None] * sx + rk[None, :]
    tl.store(out, rounded(acc, DX.dtype.element_ty), mask=(rm[:, None] < M) & (rk[None, :] < K))


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


@jit
def _dequant(Q, S, W, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    m = (rn[:, None] < N) & (rk[None, :] < K)
    at = rn.to(tl.int64)[:, None] * K + rk[None, :]
    q = tl.where(m, tl.load(Q + at, mask=m).to(tl.float32), 0.0)
    s = tl.load(S + rn, mask=rn < N, other=0.0)
    tl.store(W + at, rounded(q * s[:, None], W.dtype.element_ty), mask=m)


def _configs(a: int, b: int, c: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BM": a, "BN": b, "BK": c, "GROUP": 8}, num_warps=warps, num_stages=stages)


# tiles for the H100/H200 class first; the autotuner keeps the fastest per (MB, N, K)
_FWD = [_configs(128, 256, 64, 8, 3), _configs(128, 128, 64, 8, 4), _configs(256, 128, 64, 8, 3),
        _configs(128, 128, 64, 4, 4), _configs(64, 128, 64, 4, 4), _configs(64, 64, 64, 4, 4)]
_BWD = [_configs(128, 64, 256, 8, 3), _configs(128, 64, 128, 8, 4), _configs(256, 64, 128, 8, 3),
        _configs(128, 64, 128, 4, 4), _configs(64, 64, 128, 4, 4), _configs(64, 64, 64, 4, 4)]
_SMALL = {"BM": 16, "BN": 16, "BK": 16, "GROUP": 2}  # interpreted: the CPU tests
if INTERPRETED:
    _fwd_kernel, _bwd_kernel = _qmm_fwd, _qmm_bwd
else:
    _fwd_kernel = triton.autotune(_FWD, key=["MB", "N", "K"])(_qmm_fwd)
    _bwd_kernel = triton.autotune(_BWD, key=["MB", "N", "K"])(_qmm_bwd)


def _bucket(m: int) -> int:
    """Token counts to powers of two: the autotuner's key (a config per size class)."""
    return triton.next_power_of_2(max(m, 16))


def _meta() -> dict:
    return dict(_SMALL) if INTERPRETED else {}


def _check(op: str, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, dim: int = 1) -> None:
    """x's last size must be the codes' size ``dim`` (1: a forward, 0: an input gradient)."""
    check_tensors(op, x)
    if codes.dtype not in CODES or codes.dim() != 2 or x.shape[-1] != codes.shape[dim]:
        raise ValueError(f"{op} (triton): x {tuple(x.shape)} {x.dtype}, codes "
                         f"{tuple(codes.shape)} {codes.dtype}; want codes [N, K] in int8 or "
                         f"float8_e4m3fn with x's last size = {'NK'[dim]}")
    if scale.shape != (codes.shape[0],) or scale.dtype != torch.float32:
        raise ValueError(f"{op} (triton): scale {tuple(scale.shape)} {scale.dtype}; want float32 [N]")


def _fwd_impl(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    M, K = x.shape
    N = codes.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if out.numel():
        grid = lambda meta: (triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"]),)  # noqa: E731
        _fwd_kernel[grid](x, codes, scale, bias if bias is not None else scale, out, M, N, K,
                          _bucket(M), x.stride(0), codes.stride(0), out.stride(0),
                          HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, **_meta())
    return out


def _bwd_impl(go: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    M, N = go.shape
    K = codes.shape[1]
    dx = torch.empty((M, K), dtype=go.dtype, device=go.device)
    if dx.numel():
        go = go if go.stride(-1) == 1 else go.contiguous()
        grid = lambda meta: (triton.cdiv(M, meta["BM"]) * triton.cdiv(K, meta["BK"]),)  # noqa: E731
        _bwd_kernel[grid](go, codes, scale, dx, M, N, K, _bucket(M), go.stride(0),
                          codes.stride(0), dx.stride(0), IEEE=go.dtype == torch.float32, **_meta())
    return dx


_fwd_op = torch.library.custom_op("kohakumoss::triton_quant_linear", _fwd_impl, mutates_args=())
_bwd_op = torch.library.custom_op("kohakumoss::triton_quant_linear_bwd", _bwd_impl, mutates_args=())


@_fwd_op.register_fake
def _(x, codes, scale, bias):
    return x.new_empty((x.shape[0], codes.shape[0]))


@_bwd_op.register_fake
def _(go, codes, scale):
    return go.new_empty((go.shape[0], codes.shape[1]))


def _setup(ctx, inputs, output):
    x, codes, scale, bias = inputs
    ctx.save_for_backward(codes, scale)
    ctx.bias_grad = bias is not None and bias.requires_grad
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, go):
    codes, scale = ctx.saved_tensors
    dx = ctx.bwd(go, codes, scale) if ctx.needs_input_grad[0] else None
    db = go.float().sum(0).to(ctx.bias_dtype) if ctx.bias_grad else None
    return dx, None, None, db


_linear = entry(_fwd_op, _fwd_impl, _setup, _backward, _bwd_op, _bwd_impl)


def quant_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """``ops.quant_linear`` in Triton: the weight dequantized tile by tile inside the matmul."""
    _check("quant_linear", x, codes, scale)
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    y = _linear(x2, codes, scale, bias)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], codes.shape[0])  # 2-D: no view (accumulated into)


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


# ---- dequantize-then-matmul: one layer's weight at a time, for many rows --------------------

def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes * scale[:, None]`` in fp32, rounded once to ``dtype`` (``ops.dequantize_rows``)."""
    N, K = codes.shape
    w = torch.empty((N, K), dtype=dtype, device=codes.device)
    if w.numel():
        bn, bk = (16, 16) if INTERPRETED else (32, 256)
        _dequant[(triton.cdiv(N, bn), triton.cdiv(K, bk))](codes, scale, w, N, K, BLOCK_N=bn,
                                                          BLOCK_K=bk, num_warps=4)
    return w


class _DequantMM(torch.autograd.Function):
    """The weight dequantized into a transient buffer for each matmul (forward, then again in
    backward) and multiplied by cuBLAS; only the codes and scales are kept."""

    @staticmethod
    def forward(ctx, x2, codes, scale, bias):
        w = dequantize(codes, scale, x2.dtype)
        y = torch.nn.functional.linear(x2, w, None if bias is None else bias.to(x2.dtype))
        ctx.save_for_backward(codes, scale)
        ctx.bias_dtype = None if bias is None or not bias.requires_grad else bias.dtype
        return y

    @staticmethod
    def backward(ctx, go):
        codes, scale = ctx.saved_tensors
        dx = go @ dequantize(codes, scale, go.dtype) if ctx.needs_input_grad[0] else None
        db = go.float().sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None else None
        return dx, None, None, db


def dequant_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """``ops.quant_linear`` as dequantize-then-cuBLAS: the reference's rounding, the vendor
    GEMM's speed, one layer's weight in the compute dtype alive during each matmul (at most
    ``out x in`` elements: 96 MiB in bf16 for MOSS-Image's widest linear)."""
    _check("quant_linear", x, codes, scale)
    x2 = x.reshape(-1, x.shape[-1])
    y = _DequantMM.apply(x2, codes, scale, bias)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], codes.shape[0])  # 2-D: no view (accumulated into)
