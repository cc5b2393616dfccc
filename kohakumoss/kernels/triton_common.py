"""What the Triton kernels share: how they are jitted, where they can run, launch sizes, the
per-sample row order their backward reductions walk, and fp32 math helpers.

Importing this module imports Triton; ``kohakumoss.kernels.backends`` imports it lazily, so a
machine without Triton reports the Triton backends unavailable instead of failing.

Interpreted or compiled is decided once per process, when ``triton`` is first imported:
with ``TRITON_INTERPRET=1`` set by then, Triton's own library functions (``tl.sum``...) are
interpreted and so are ours; the kernels then run on CPU tensors (tests, CI). Otherwise
they compile for CUDA devices of compute capability 8.0 or more.

Legend: R rows (tokens, or tokens x heads), C columns, B samples, K row chunks per sample.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

INTERPRETED = isinstance(tl.sum, InterpretedFunction)
"""Triton's language was built interpreted (``TRITON_INTERPRET=1`` at its first import)."""
_INTERPRETED = tl.constexpr(INTERPRETED)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes every Triton kernel takes and returns; the math inside is fp32."""


def jit(fn):
    """``triton.jit`` in the mode Triton's language was built in, whatever the environment
    says now: a kernel and the library functions it calls must be of the same kind."""
    return InterpretedFunction(fn) if INTERPRETED else JITFunction(fn)


def can_run(device: torch.device) -> bool:
    """Interpreted: CPU only. Compiled: CUDA (NVIDIA) with compute capability >= 8.0."""
    if INTERPRETED:
        return device.type == "cpu"
    if device.type != "cuda" or not torch.cuda.is_available() or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


_RUNS: dict[torch.device, bool] = {}


def check_tensors(op: str, *tensors: torch.Tensor) -> None:
    """Same device, a runnable one, dtypes the kernels take: else a clear error."""
    device = tensors[0].device
    for t in tensors:
        if t.dtype not in DTYPES:
            raise TypeError(f"{op} (triton): a {t.dtype} input; the kernels take "
                            f"float32, bfloat16 and float16 (use the reference for others)")
        if t.device != device:
            raise ValueError(f"{op} (triton): inputs on {device} and {t.device}; "
                             f"put them on one device")
    if torch.compiler.is_compiling():
        return
    if device not in _RUNS:
        _RUNS[device] = can_run(device)
    if not _RUNS[device]:
        where = ("CPU tensors (interpreted)" if INTERPRETED
                 else "CUDA devices of compute capability 8.0+")
        raise RuntimeError(f"{op} (triton): cannot run on {device}; Triton runs here on {where}")


def lastdim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


ELEMENTS_PER_WARP = 512
"""Elements of a tile per warp in the elementwise kernels (SiTU, the residual adds)."""
ROW_ELEMENTS_PER_WARP = 1024
"""The same for the kernels that reduce over a row (the norms, qk-norm): on an H200 a
3072-wide row ran fastest with 4 warps (``bench/bench_kernels.py --sweep``)."""


def warps(tile: int, per_warp: int | None = None) -> int:
    """Warps for a tile of ``tile`` elements, ``per_warp`` (``ELEMENTS_PER_WARP``) each: 1 to 16."""
    return max(1, min(16, tile // (per_warp or ELEMENTS_PER_WARP)))


def row_warps(tile: int) -> int:
    return warps(tile, ROW_ELEMENTS_PER_WARP)


_SMS: dict[int, int] = {}
PROGRAMS_PER_SM = 4
"""Programs per multiprocessor of the row-reducing backward kernels: each walks its rows
one tile after another, so several per SM hide the loads' latency; each also writes one
fp32 partial row per reduced tensor (summed after)."""


def programs(device: torch.device) -> int:
    """How many programs the row-reducing backward kernels spread over."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return PROGRAMS_PER_SM * _SMS[index]


_ORDERS: dict[int, tuple] = {}  # id(seg) -> (weakref, version, B, order, starts); a few entries


def segment_order(seg_N: torch.Tensor, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``order`` [N] int32: token indices grouped by sample, in token order within a sample;
    ``starts`` [B+1] int32: where each sample's group begins in ``order``).

    The backward kernels walk each sample's tokens through these, so a per-sample reduction
    is a sum in registers plus one fixed-order sum of per-chunk partials: deterministic, no
    atomics, and any ``seg`` order works (the packed layout's is sorted). Every block of a
    step passes the same ``seg`` tensor, so the last few are remembered (by identity and
    version; the tensor is held weakly).
    """
    key = id(seg_N)
    hit = _ORDERS.get(key)
    if hit is not None and hit[0]() is seg_N and hit[1] == seg_N._version and hit[2] == samples:
        return hit[3], hit[4]
    values, order = torch.sort(seg_N, stable=True)
    bounds = torch.arange(samples + 1, dtype=values.dtype, device=seg_N.device)
    starts = torch.searchsorted(values, bounds).to(torch.int32)  # no host sync (bincount has one)
    order = order.to(torch.int32)
    if len(_ORDERS) >= 8:
        _ORDERS.pop(next(iter(_ORDERS)))
    _ORDERS[key] = (weakref.ref(seg_N), seg_N._version, samples, order, starts)
    return order, starts


@jit
def _tanh_series(x):
    """tanh for 0 <= x < 0.25: its odd Taylor polynomial to x^9 (error below 1e-9 there)."""
    x2 = x * x
    return x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333
                + x2 * (-0.05396825396825397 + x2 * 0.021869488536155203))))


@jit
def tanh_nonneg(x):
    """tanh(x) for x >= 0 in fp32 to a few ulp, from one ``exp2`` (no libdevice: the
    interpreter lacks it): the series below 0.25, ``(1 - e^-2x) / (1 + e^-2x)`` above."""
    b = tl.exp2(x * -2.885390081777927)  # e^(-2x)
    return tl.where(x < 0.25, _tanh_series(x), (1.0 - b) / (1.0 + b))


@jit
def gate_parts(g):
    """For SiTU's gate: ``(tanh(|g|/4), sigmoid(|g|), e^-|g|)`` from one ``exp2`` and one
    division. With ``a = e^(-|g|/2)``: ``tanh(|g|/4) = (1 - a) / (1 + a)`` and
    ``sigmoid(|g|) = 1 / (1 + a^2)``; ``a <= 1``, so nothing overflows."""
    ag = tl.abs(g)
    a = tl.exp2(ag * -0.7213475204444817)  # e^(-|g|/2)
    one_a = 1.0 + a
    one_a2 = 1.0 + a * a
    num = tl.where(ag < 1.0, _tanh_series(0.25 * ag) * one_a, 1.0 - a)
    r = 1.0 / (one_a * one_a2)
    return num * one_a2 * r, one_a * r, a * a


@jit
def situ_gate(g):
    """SiTU's gate ``4 tanh(g/4) sigmoid(g)`` from one ``exp2`` and one division, for the
    forward (``gate_parts`` gives the backward its pieces): with ``a = e^(-|g|/2)``,
    ``v = 4 (1 - a) / ((1 + a)(1 + a^2))`` for g >= 0 and ``-v a^2`` below (``1 - a`` from
    the series where it would cancel). Over [-30, 30] its fp32 error against float64 is that
    of the pieces' product (max 1.8e-6 relative, a median of 6e-8), in four fewer products."""
    ag = tl.abs(g)
    a = tl.exp2(ag * -0.7213475204444817)  # e^(-|g|/2)
    one_a = 1.0 + a
    a2 = a * a
    num = tl.where(ag < 1.0, _tanh_series(0.25 * ag) * one_a, 1.0 - a)
    v = 4.0 * num / (one_a * (1.0 + a2))
    return tl.where(g >= 0.0, v, -v * a2)


@jit
def rounded(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even ``dtype``: the one rounding out. The interpreter
    truncates fp32 -> bf16, so there the rounding is done on the bits (carry into the
    exponent included); compiled Triton rounds to nearest-even itself."""
    if _INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


