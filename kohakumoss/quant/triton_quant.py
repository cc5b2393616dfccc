"""Triton linears over a quantized frozen weight (``model/ops.py``: ``quant_linear``, and
``dequantize`` for ``fp8_linear``'s bf16 input gradient; fp8 compute's activation
quantization is ``triton_fp8.py``).

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

Below sm89 (A100, the RTX 30 series) Triton has no e4m3 type: there fp8 codes are passed as
their bytes and decoded by integer operations (``_widen_codes``), exactly.

fp32 inputs are multiplied in full fp32 (``input_precision="ieee"``), not TF32. Compiled,
each kernel is autotuned per (token bucket, N, K); interpreted (``TRITON_INTERPRET=1``, the
CPU tests) one small tile is used.

Legend: M rows (tokens), N output features, K input features.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kohakumoss.kernels.custom import entry
from kohakumoss.kernels.triton_common import INTERPRETED, check_tensors, jit, rounded

CODES = (torch.int8, torch.float8_e4m3fn)
E4M3_BYTES: bool | None = None
"""fp8 codes read as bytes and decoded by the kernels (True), or as Triton's e4m3 type
(False); None: bytes on cards below sm89, which have no e4m3 type."""
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
def _widen_codes(q, BYTES: tl.constexpr):
    """Codes as loaded -> float32. ``BYTES``: e4m3 codes as uint8, decoded exactly by placing
    sign, exponent and mantissa in a float16's fields (e4m3's exponent bias is 7, float16's
    15: times 2^8 after; e4m3's subnormals land on float16's); 0x7f / 0xff (e4m3's NaN) read
    as +-480, codes of finite weights never hold them."""
    if BYTES:
        h = q.to(tl.uint16)
        bits = ((h & 0x80) << 8) | ((h & 0x7F) << 7)
        return bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    else:
        return q.to(tl.float32)


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
             IEEE: tl.constexpr, BYTES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, GROUP: tl.constexpr):
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
        b = tl.where(bm, _widen_codes(tl.load(qp, mask=bm), BYTES), 0.0).to(a.dtype)
        acc = _mma(a, b, acc, IEEE)
        xp += BK
        qp += BK
    acc = acc * tl.load(S + rn, mask=rn < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out = OUT + rm.to(tl.int64)[:, None] * so + rn[None, :]
    tl.store(out, rounded(acc, OUT.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@jit
def _qmm_bwd(DY, Q, S, DX, M, N, K, MB, sd, sq, sx, IEEE: tl.constexpr, BYTES: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
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
        b = tl.where(bm, _widen_codes(tl.load(qp, mask=bm), BYTES), 0.0)
        acc = _mma(a, rounded(b * s[:, None], a.dtype), acc, IEEE)
        dp += BN
        qp += BN * sq
    out = DX + rm.to(tl.int64)[:, None] * sx + rk[None, :]
    tl.store(out, rounded(acc, DX.dtype.element_ty), mask=(rm[:, None] < M) & (rk[None, :] < K))


@jit
def _dequant(Q, S, W, N, K, BYTES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    m = (rn[:, None] < N) & (rk[None, :] < K)
    at = rn.to(tl.int64)[:, None] * K + rk[None, :]
    q = tl.where(m, _widen_codes(tl.load(Q + at, mask=m), BYTES), 0.0)
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


def _as_loaded(codes: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(the codes as the kernels load them, whether as e4m3 bytes): ``E4M3_BYTES``. The kernels
    read rows ``K`` apart: codes held otherwise (beside fp8 compute's slot columns,
    ``QuantizedLinear.hold_slots``) are copied first."""
    codes = codes if codes.is_contiguous() else codes.contiguous()
    if codes.dtype != torch.float8_e4m3fn:
        return codes, False
    as_bytes = E4M3_BYTES
    if as_bytes is None:
        as_bytes = not native_e4m3(codes.device)
    return (codes.view(torch.uint8), True) if as_bytes else (codes, False)


_NATIVE: dict[torch.device, bool] = {}


def native_e4m3(device: torch.device) -> bool:
    """Triton has the e4m3 type here: the CPU (interpreted) and CUDA sm89+; asked once a device."""
    if device not in _NATIVE:
        _NATIVE[device] = device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)
    return _NATIVE[device]


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
        codes, as_bytes = _as_loaded(codes)
        grid = lambda meta: (triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"]),)  # noqa: E731
        _fwd_kernel[grid](x, codes, scale, bias if bias is not None else scale, out, M, N, K,
                          _bucket(M), x.stride(0), codes.stride(0), out.stride(0),
                          HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, BYTES=as_bytes,
                          **_meta())
    return out


def _bwd_impl(go: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    M, N = go.shape
    K = codes.shape[1]
    dx = torch.empty((M, K), dtype=go.dtype, device=go.device)
    if dx.numel():
        go = go if go.stride(-1) == 1 else go.contiguous()
        codes, as_bytes = _as_loaded(codes)
        grid = lambda meta: (triton.cdiv(M, meta["BM"]) * triton.cdiv(K, meta["BK"]),)  # noqa: E731
        _bwd_kernel[grid](go, codes, scale, dx, M, N, K, _bucket(M), go.stride(0),
                          codes.stride(0), dx.stride(0), IEEE=go.dtype == torch.float32,
                          BYTES=as_bytes, **_meta())
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


# ---- dequantize-then-matmul: one layer's weight at a time, for many rows --------------------

def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes * scale[:, None]`` in fp32, rounded once to ``dtype`` (``ops.dequantize_rows``)."""
    N, K = codes.shape
    w = torch.empty((N, K), dtype=dtype, device=codes.device)
    if w.numel():
        bn, bk = (16, 16) if INTERPRETED else (32, 256)
        codes, as_bytes = _as_loaded(codes)
        _dequant[(triton.cdiv(N, bn), triton.cdiv(K, bk))](codes, scale, w, N, K, BYTES=as_bytes,
                                                          BLOCK_N=bn, BLOCK_K=bk, num_warps=4)
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
