"""The ``tilelang`` backend: ``rms_norm``, ``modulated_rms_norm``, ``situ``,
``gated_residual`` and ``varlen_attention`` as ``torch.library`` custom ops over the TileLang
kernels of ``kernels.py``, with fake and autograd registrations.

Where it runs: CUDA (NVIDIA) devices of compute capability 7.0+; bf16 from 8.0. The norms,
SiTU and the gated add take fp32, bf16 and fp16; attention takes bf16 and fp16 with head dims
a multiple of 32 up to 256. On sm70 / sm75 (V100, T4, RTX 20xx), where Triton does not run,
these are the fused kernels there are; on sm80+ the tuner times them only when
``kernels.backends`` names ``tilelang`` (each kernel's first build costs nvcc seconds, which a
first run's tuning budget should not pay for kernels Triton already covers).

Each kernel compiles once per process and static sizes (feature width, heads, head dim,
dtypes: ``_build``), and TileLang keeps the binaries in its disk cache across processes.
The parameter gradients (norm weight, shift and scale, gate: full finetunes and
``adapter.train_norms`` only) are per-sample sums in fp32 by torch, from the same fp32 math.

Importing this module imports TileLang; ``kohakumoss.kernels.backends`` imports it lazily.
"""

from __future__ import annotations

import functools
import itertools
import math

import tilelang
import torch

from kohakumoss.kernels.attention import varlen as attention
from kohakumoss.experimental.tilelang import kernels as K
from kohakumoss.kernels.custom import entry, gated_residual_setup, like, packed_halves, rows2d

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ATTENTION_DTYPES = (torch.bfloat16, torch.float16)
_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def can_run(device: torch.device, dtype: torch.dtype, attention: bool = False) -> bool:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or torch.version.hip is not None:
        return False
    if dtype not in (ATTENTION_DTYPES if attention else DTYPES):
        return False
    cc = torch.cuda.get_device_capability(device)
    return cc >= ((8, 0) if dtype == torch.bfloat16 else (7, 0))


@functools.lru_cache(maxsize=None)
def _build(name: str, *static):
    """The compiled kernel of builder ``name`` for these static sizes (once per process)."""
    return tilelang.compile(getattr(K, name)(*static))


def _check(op: str, *tensors: torch.Tensor) -> None:
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"{op} (tilelang): inputs on {device} and {t.device}; put them on one device")
        if t.dtype not in DTYPES:
            raise TypeError(f"{op} (tilelang): a {t.dtype} input; the kernels take float32, bfloat16 "
                            f"and float16 (use the reference for others)")
    if not torch.compiler.is_compiling() and not can_run(device, tensors[0].dtype):
        raise RuntimeError(f"{op} (tilelang): cannot run {tensors[0].dtype} on {device}; TileLang "
                           f"runs here on CUDA devices of compute capability 7.0+ (bf16: 8.0+)")


def _op(name: str, impl, fake):
    op = torch.library.custom_op(f"kohakumoss::tilelang_{name}", impl, mutates_args=())
    op.register_fake(fake)
    return op


# ---- RMSNorm and modulated RMSNorm ----------------------------------------------------------

def _row_threads(D: int) -> int:
    """A row's threads: 256 for the model's widths; a divisor of D for others (the row's
    fragment spreads evenly over the block's threads)."""
    return math.gcd(D, 256)


def _norm_impl(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
               seg: torch.Tensor, eps: float, modulated: bool) -> torch.Tensor:
    out = like(x)
    if x.shape[0]:
        _build("norm_forward", x.shape[1], _NAMES[x.dtype], _NAMES[weight.dtype],
               _NAMES[scale.dtype], modulated, _row_threads(x.shape[1]))(
            x, weight, shift, scale, seg, out, eps)
    return out


def _norm_bwd_impl(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   seg: torch.Tensor, eps: float, modulated: bool) -> torch.Tensor:
    dx = like(x)
    if x.shape[0]:
        _build("norm_backward", x.shape[1], _NAMES[x.dtype], _NAMES[weight.dtype],
               _NAMES[scale.dtype], modulated, _row_threads(x.shape[1]))(
            g.contiguous(), x, weight, scale, seg, dx, eps)
    return dx


_norm_op = _op("norm", _norm_impl, lambda x, weight, shift, scale, seg, eps, modulated: like(x))
_norm_bwd_op = _op("norm_bwd", _norm_bwd_impl,
                   lambda g, x, weight, scale, seg, eps, modulated: like(x))


def _norm_setup(ctx, inputs, output):
    x, weight, shift, scale, seg, eps, modulated = inputs
    ctx.save_for_backward(x, weight, scale, seg)
    ctx.eps, ctx.modulated = eps, modulated


def _norm_backward(ctx, g):
    x, weight, scale, seg = ctx.saved_tensors
    dx = ctx.bwd(g, x, weight, scale, seg, ctx.eps, ctx.modulated)
    dw = dsh = dsc = None
    need_w, need_sh, need_sc = ctx.needs_input_grad[1:4]
    if need_w or (ctx.modulated and (need_sh or need_sc)):  # fp32 per-sample sums
        xf = x.float()
        xh = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)
        gf = g.float()
        gy = gf * (1 + scale.float()[seg]) if ctx.modulated else gf
        if need_w:
            dw = (gy * xh).sum(0).to(weight.dtype)
        if ctx.modulated and need_sh:
            dsh = torch.zeros(scale.shape, dtype=torch.float32, device=x.device).index_add_(0, seg, gf)
        if ctx.modulated and need_sc:
            dsc = torch.zeros(scale.shape, dtype=torch.float32, device=x.device).index_add_(
                0, seg, gf * xh * weight.float())
    return dx, dw, dsh, dsc, None, None, None


_norm = entry(_norm_op, _norm_impl, _norm_setup, _norm_backward, _norm_bwd_op, _norm_bwd_impl)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``ops.rms_norm`` in TileLang: x of any leading shape, normalised over its last dim."""
    _check("rms_norm", x, weight)
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"rms_norm (tilelang): weight {tuple(weight.shape)} for {D} features")
    x2 = rows2d(x, D).contiguous()
    row = weight.view(1, D)
    seg = torch.zeros(x2.shape[0], dtype=torch.long, device=x.device)
    return _norm(x2, weight.contiguous(), row, row, seg, float(eps), False).view(x.shape)


def modulated_rms_norm(x_ND: torch.Tensor, weight: torch.Tensor, shift_BD: torch.Tensor,
                       scale_BD: torch.Tensor, seg_N: torch.Tensor, eps: float) -> torch.Tensor:
    """``ops.modulated_rms_norm`` in TileLang. ``seg_N`` values must lie in [0, B)."""
    _check("modulated_rms_norm", x_ND, weight, shift_BD, scale_BD)
    N, D = x_ND.shape
    if weight.shape != (D,) or shift_BD.shape != scale_BD.shape or shift_BD.dim() != 2 \
            or shift_BD.shape[1] != D or seg_N.shape != (N,) or shift_BD.dtype != scale_BD.dtype:
        raise ValueError(f"modulated_rms_norm (tilelang): x {tuple(x_ND.shape)}, weight "
                         f"{tuple(weight.shape)}, shift {tuple(shift_BD.shape)}, scale "
                         f"{tuple(scale_BD.shape)}, seg {tuple(seg_N.shape)}; want [N, D], [D], "
                         f"[B, D], [B, D] (shift and scale in one dtype), [N]")
    return _norm(x_ND.contiguous(), weight.contiguous(), shift_BD.contiguous(), scale_BD.contiguous(),
                 seg_N.long(), float(eps), True)


# ---- SiTU ------------------------------------------------------------------------------------

def _situ_impl(ug: torch.Tensor) -> torch.Tensor:
    F = ug.shape[1] // 2
    out = like(ug, (ug.shape[0], F))
    if ug.shape[0]:
        _build("situ_forward", F, _NAMES[ug.dtype])(ug, out)
    return out


def _situ_bwd_impl(go: torch.Tensor, ug: torch.Tensor) -> torch.Tensor:
    d = like(ug)
    if ug.shape[0]:
        _build("situ_backward", ug.shape[1] // 2, _NAMES[ug.dtype])(go.contiguous(), ug, d)
    return d


_situ_op = _op("situ", _situ_impl, lambda ug: like(ug, (ug.shape[0], ug.shape[1] // 2)))
_situ_bwd_op = _op("situ_bwd", _situ_bwd_impl, lambda go, ug: like(ug))


def _situ_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _situ_backward(ctx, go):
    return ctx.bwd(go, *ctx.saved_tensors)


_situ = entry(_situ_op, _situ_impl, _situ_setup, _situ_backward, _situ_bwd_op, _situ_bwd_impl)


def situ(u: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``ops.situ`` in TileLang. The kernel reads u and g as the halves of one [N, 2F] row:
    the up|gate output itself when they are its halves (``packed_halves``, the gradient then
    written whole), else a joined copy."""
    _check("situ", u, g)
    if u.shape != g.shape or u.dtype != g.dtype:
        raise ValueError(f"situ (tilelang): u {tuple(u.shape)} {u.dtype}, g {tuple(g.shape)} "
                         f"{g.dtype}; want one shape and dtype")
    F = u.shape[-1] if u.dim() else 1
    ug = packed_halves(u, g)
    if ug is None:
        ug = torch.cat([rows2d(u, F), rows2d(g, F)], dim=1)
    return _situ(rows2d(ug, 2 * F).contiguous()).view(u.shape)


# ---- gated residual add ----------------------------------------------------------------------

def _gated_impl(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    out = like(x)
    if x.shape[0]:
        _build("gated_residual_forward", x.shape[1], _NAMES[x.dtype], _NAMES[gate.dtype])(
            x, y, gate, seg, out)
    return out


def _gated_bwd_impl(go: torch.Tensor, gate: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    dy = like(go)
    if go.shape[0]:
        _build("gated_gradient", go.shape[1], _NAMES[go.dtype], _NAMES[gate.dtype])(go, gate, seg, dy)
    return dy


_gated_op = _op("gated_residual", _gated_impl, lambda x, y, gate, seg: like(x))
_gated_bwd_op = _op("gated_residual_bwd", _gated_bwd_impl, lambda go, gate, seg: like(go))


def _gated_backward(ctx, go):
    y, gate, seg = ctx.saved_tensors
    go = go.contiguous()
    dy = ctx.bwd(go, gate, seg) if ctx.needs_input_grad[1] else None
    dgate = None
    if ctx.needs_input_grad[2]:  # fp32 per-sample sums; autograd casts to the gate's dtype
        dgate = torch.zeros(gate.shape, dtype=torch.float32, device=go.device).index_add_(
            0, seg, go.float() * y.float())
    return go.to(ctx.x_dtype), dy, dgate, None


_gated = entry(_gated_op, _gated_impl, gated_residual_setup, _gated_backward, _gated_bwd_op,
               _gated_bwd_impl)


def gated_residual(x_ND: torch.Tensor, y_ND: torch.Tensor, gate_BD: torch.Tensor,
                   seg_N: torch.Tensor) -> torch.Tensor:
    """``ops.gated_residual`` in TileLang: ``x + gate[seg] y``; ``seg_N`` values lie in [0, B)."""
    _check("gated_residual", x_ND, y_ND, gate_BD)
    N, D = x_ND.shape
    if y_ND.shape != x_ND.shape or y_ND.dtype != x_ND.dtype or gate_BD.dim() != 2 \
            or gate_BD.shape[1] != D or seg_N.shape != (N,):
        raise ValueError(f"gated_residual (tilelang): x {tuple(x_ND.shape)} {x_ND.dtype}, y "
                         f"{tuple(y_ND.shape)} {y_ND.dtype}, gate {tuple(gate_BD.shape)}, seg "
                         f"{tuple(seg_N.shape)}; want [N, D] twice in one dtype, [B, D], [N]")
    return _gated(x_ND.contiguous(), y_ND.contiguous(), gate_BD.contiguous(), seg_N.long())


# ---- varlen attention ------------------------------------------------------------------------

SHARED_KIB = {(7, 0): 96, (7, 5): 64, (8, 0): 163, (9, 0): 227}
"""Shared memory a block may take, KiB, by compute capability (other sm8x: 99)."""
FORWARD_TILES = ((128, 128), (128, 64), (64, 64), (64, 32), (32, 32))  # queries x keys
BACKWARD_TILES = (64, 32, 16)  # a backward block's keys, and the query tiles it walks


def pipeline_stages(capability: tuple[int, int]) -> int:
    """Copy stages in flight: 2 on sm90 (TMA) and before sm80; 1 on sm80-sm89, where TileLang
    0.1.15 cannot emit the wait of a deeper ``cp.async`` pipeline over a dynamic loop."""
    return 1 if (8, 0) <= tuple(capability) < (9, 0) else 2


def attention_tiles(capability: tuple[int, int], Dh: int, elem: int = 2) -> tuple[tuple, tuple]:
    """``(BM, BN, stages, threads)`` of the forward and ``(T, T, stages, threads)`` of the
    backward: the largest tiles whose shared memory fits the card (a stage fewer, then smaller
    tiles, where the deeper pipeline does not)."""
    cc = tuple(capability)
    limit = SHARED_KIB.get(cc, 99 if cc[0] == 8 else 96) * 1024

    def fwd_bytes(bm, bn, st):
        return elem * Dh * (bm + 2 * st * bn)

    def bwd_bytes(t, st):
        return elem * (2 * t * Dh + 2 * st * t * Dh + 2 * t * t) + 8 * st * t

    deepest = pipeline_stages(cc)
    stages = range(deepest, 0, -1)
    bm, bn, fs = next(((bm, bn, st) for bm, bn in FORWARD_TILES for st in stages
                       if fwd_bytes(bm, bn, st) <= limit), (*FORWARD_TILES[-1], 1))
    t, bs = next(((t, st) for t in BACKWARD_TILES for st in stages if bwd_bytes(t, st) <= limit),
                 (BACKWARD_TILES[-1], 1))
    # 8 warps split a 64-row tile's narrow products wrongly below a head dim of 64
    return (bm, bn, fs, 256 if bm >= 128 else 128), (t, t, bs, 256 if Dh >= 64 and t >= 64 else 128)


def _segments(lengths: list[int], device: torch.device) -> tuple[torch.Tensor, int]:
    """Cumulative starts of the non-empty segments (int32 on the device) and the longest."""
    kept = [n for n in lengths if n > 0]
    cu = torch.tensor([0, *itertools.accumulate(kept)], dtype=torch.int32).to(device, non_blocking=True)
    return cu, max(kept, default=0)


def _attn_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    N, H, Dh = q.shape
    o = like(q)
    lse = like(q, (N, H), torch.float32)
    cu, longest = _segments(lengths, q.device)
    if longest:
        fwd, _ = attention_tiles(torch.cuda.get_device_capability(q.device), Dh, q.element_size())
        _build("attention_forward", H, Dh, _NAMES[q.dtype], *fwd)(
            q, k, v, cu, o, lse, math.ceil(longest / fwd[0]))
    return o, lse


def _attn_bwd_impl(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                   lse: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    N, H, Dh = q.shape
    dq32 = torch.zeros((N, H, Dh), dtype=torch.float32, device=q.device)
    dk, dv = like(k), like(v)
    cu, longest = _segments(lengths, q.device)
    if longest:
        do = do.contiguous()
        delta = (do.float() * o.float()).sum(-1)
        _, bwd = attention_tiles(torch.cuda.get_device_capability(q.device), Dh, q.element_size())
        _build("attention_backward", H, Dh, _NAMES[q.dtype], *bwd)(
            q, k, v, do, lse, delta, cu, dq32, dk, dv, math.ceil(longest / bwd[0]))
    return dq32.to(q.dtype), dk, dv


_attn_op = _op("attention", _attn_impl,
               lambda q, k, v, lengths: (like(q), like(q, q.shape[:2], torch.float32)))
_attn_bwd_op = _op("attention_bwd", _attn_bwd_impl,
                   lambda do, q, k, v, o, lse, lengths: (like(q), like(k), like(v)))


def _attn_setup(ctx, inputs, output):
    q, k, v, lengths = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.lengths = lengths
    ctx.mark_non_differentiable(lse)


def _attn_backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = ctx.bwd(do, q, k, v, o, lse, ctx.lengths)
    return dq, dk, dv, None


_attn = entry(_attn_op, _attn_impl, _attn_setup, _attn_backward, _attn_bwd_op, _attn_bwd_impl)


def varlen_attention(q_NHd: torch.Tensor, k_NHd: torch.Tensor, v_NHd: torch.Tensor,
                     lengths: list[int]) -> torch.Tensor:
    """``ops.varlen_attention`` in TileLang: softmax attention within each contiguous segment."""
    _check("varlen_attention", q_NHd, k_NHd, v_NHd)
    lengths = [int(n) for n in lengths]
    attention._check("tilelang", q_NHd, k_NHd, v_NHd, lengths)
    if q_NHd.dtype not in ATTENTION_DTYPES or not attention.tilelang_fits({"Dh": q_NHd.shape[-1]}):
        raise TypeError(f"varlen_attention (tilelang): {q_NHd.dtype} with head dim "
                        f"{q_NHd.shape[-1]}; the kernel takes bf16/fp16 and head dims a "
                        f"multiple of 32 up to 256")
    o, _ = _attn(q_NHd.contiguous(), k_NHd.contiguous(), v_NHd.contiguous(), lengths)
    return o
