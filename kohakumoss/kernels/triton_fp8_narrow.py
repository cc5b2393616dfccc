"""The row quantization of fp8 compute's ``full`` node with its LoRA's narrow product made on
the way (``fp8_compute._Fp8Loras``): ``rows_narrow``.

Without it the node reads each activation row twice: once for the narrow product (``h = x
A^T`` forward, ``t = [dy_1 B_1 | ...]`` in backward, cuBLAS) and once for its e4m3 codes,
whose row ``[x | h g]`` needs ``h`` first (``triton_fp8.fp8_rows_joined`` with a tail). Here
one program takes a block of rows: the first walk over their columns sums the narrow product
on the tensor cores (``tl.dot``, float32, rounded once to the activations' dtype as the
narrow product rounds) and the rows' largest magnitudes; the second walk, over the same rows
just read, writes the codes under each row's scale. That second read comes from L2 only if
the rows in flight fit it (~50 MB on an H100/H200): a launch of a few programs an SM, each
walking many blocks, keeps them few. The
narrow product's sums run in another order than cuBLAS's, so ``h`` may differ from it by a
rounding; everything after ``h`` is ``fp8_rows_joined``'s, code for code
(``tests/test_quant_kernels.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kohakumoss.kernels.triton_common import INTERPRETED, check_tensors, jit
from kohakumoss.kernels.triton_fp8 import _row_source, _to_e4m3
from kohakumoss.model.quant_ops import slot_width

_INTERPRETED = tl.constexpr(INTERPRETED)


@jit
def _row_codes(v, s):
    return _to_e4m3(tl.minimum(tl.maximum(v / s[:, None], -448.0), 448.0))


@jit
def _rows_block(blk, X0, X1, X2, F0, F1, F2, CS, A, H, Q, S, M, K, R, QW, sx0, sx1, sx2,
                fk0, fr0, fk1, fr1, fk2, fr2, w0, w1, NSRC: tl.constexpr, COLS: tl.constexpr,
                BM: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr):
    """Rows ``blk * BM ..`` of ``_rows_narrow``."""
    rm = (blk * BM + tl.arange(0, BM)).to(tl.int64)
    mm = rm < M
    rc = tl.arange(0, RP)
    rk0 = tl.arange(0, BK)
    acc = tl.zeros((BM, RP), dtype=tl.float32)
    amax = tl.zeros((BM,), dtype=tl.float32)
    for j in tl.static_range(NSRC):
        X = _row_source(j, X0, X1, X2) + rm[:, None] * _row_source(j, sx0, sx1, sx2)
        F = _row_source(j, F0, F1, F2)
        fk, fr = _row_source(j, fk0, fk1, fk2), _row_source(j, fr0, fr1, fr2)
        cj = rc - _row_source(j, 0, w0, w0 + w1)  # this source's columns of h
        mc = (cj >= 0) & (cj < _row_source(j, w0, w1, R - w0 - w1))
        for k0 in range(0, K, BK):
            rk = k0 + rk0
            mk = rk < K
            x = tl.load(X + rk[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
            f = tl.load(F + rk[:, None] * fk + cj[None, :] * fr, mask=mk[:, None] & mc[None, :], other=0.0)
            if _INTERPRETED:  # the interpreter's dot of bf16 tiles reads their bits as integers
                acc = tl.dot(x.to(tl.float32), f.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, f.to(x.dtype), acc)
            xf = x.to(tl.float32)
            if COLS:
                xf = xf * tl.load(CS + j * K + rk, mask=mk, other=0.0)[None, :]
            amax = tl.maximum(amax, tl.max(tl.abs(xf), axis=1))
    h = acc.to(H.dtype.element_ty)
    mr = rc < R
    tl.store(H + rm[:, None] * R + rc[None, :], h, mask=mm[:, None] & mr[None, :])
    t = h.to(tl.float32) * (tl.load(A + rc, mask=mr, other=0.0) / 448.0)[None, :]
    s = tl.maximum(amax, tl.max(tl.abs(t), axis=1)) / 448.0
    s = tl.where(s > 0.0, s, 1.0)
    out = Q + rm[:, None] * QW
    for j in tl.static_range(NSRC):
        X = _row_source(j, X0, X1, X2) + rm[:, None] * _row_source(j, sx0, sx1, sx2)
        for k0 in range(0, K, BK):
            rk = k0 + rk0
            m = mm[:, None] & (rk < K)[None, :]
            xf = tl.load(X + rk[None, :], mask=m, other=0.0).to(tl.float32)
            if COLS:
                xf = xf * tl.load(CS + j * K + rk, mask=rk < K, other=0.0)[None, :]
            tl.store(out + j * K + rk[None, :], _row_codes(xf, s), mask=m)
    tl.store(out + NSRC * K + rc[None, :], _row_codes(t, s), mask=mm[:, None] & (NSRC * K + rc < QW)[None, :])
    tl.store(S + rm, s, mask=mm)


@jit
def _rows_narrow(X0, X1, X2, F0, F1, F2, CS, A, H, Q, S, M, K, R, QW, sx0, sx1, sx2,
                 fk0, fr0, fk1, fr1, fk2, fr2, w0, w1, NSRC: tl.constexpr, COLS: tl.constexpr,
                 BM: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr, WALK: tl.constexpr):
    """Blocks of BM rows of ``[X0 | X1 | X2][:, :NSRC * K] (times CS where COLS)``, each row
    followed by ``h * A / 448`` (R wide, zeros to QW), as e4m3 codes under one scale a row,
    into Q (QW wide); ``h = [X_0 F_0 | X_1 F_1 | X_2 F_2]`` (F_j [K, w_j], w_2 = R - w_0 - w_1;
    its element (k, c) at ``F_j + k fk_j + c fr_j``) into H [M, R], rounded to H's dtype. Each
    source row is read twice: for ``h`` and the amax, then for the codes. One program a block,
    or with ``WALK`` program p takes the blocks p, p + programs, ..: a grid of a few programs
    an SM, so that the rows a program just read are few enough to be read again from L2 (a
    variant of its own: the walk costs registers)."""
    if WALK:
        for blk in range(tl.program_id(0), tl.cdiv(M, BM), tl.num_programs(0)):
            _rows_block(blk, X0, X1, X2, F0, F1, F2, CS, A, H, Q, S, M, K, R, QW, sx0, sx1, sx2,
                        fk0, fr0, fk1, fr1, fk2, fr2, w0, w1, NSRC, COLS, BM, BK, RP)
    else:
        _rows_block(tl.program_id(0), X0, X1, X2, F0, F1, F2, CS, A, H, Q, S, M, K, R, QW, sx0, sx1,
                    sx2, fk0, fr0, fk1, fr1, fk2, fr2, w0, w1, NSRC, COLS, BM, BK, RP)


def narrow_launch(R: int) -> tuple[int, int, int, int]:
    """``_rows_narrow``'s launch for R narrow columns: (rows a block, columns a step, warps,
    programs: 0 for one a block, else that many walking the blocks); interpreted, small
    blocks. Not yet swept on a GPU (``bench/bench_fp8_rows.py --narrow``)."""
    if INTERPRETED:
        return 16, 16, 4, 0
    return 64, 64, 4 if R <= 64 else 8, 0


def rows_narrow(xs: list[torch.Tensor], factors: list[torch.Tensor], amax: torch.Tensor,
                col_scale: torch.Tensor | None = None, launch: tuple[int, int, int, int] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``h = [xs[0] @ factors[0] | xs[1] @ factors[1] | ..]`` (``factors[j]`` [K, r_j], any
    strides: ``down.t()`` forward, each ``up`` in backward), rounded to xs' dtype, and
    ``fp8_rows_joined(xs, col_scale, (h, amax))``: returns ``(h [M, R], codes [M, n K +
    slot_width(R)], scales [M])``. One to three [M, K] sources (rows contiguous, any row
    stride), bf16 or fp16; ``amax`` [R] float32 (``lora_amax``'s or A's row maxima)."""
    if not 1 <= len(xs) <= 3 or len(factors) != len(xs) or \
            any(x.dim() != 2 or x.shape != xs[0].shape for x in xs):
        raise ValueError(f"rows_narrow: one to three 2-D sources of one shape and a factor each, got "
                         f"{[tuple(x.shape) for x in xs]} and {len(factors)} factors")
    (M, K), n = xs[0].shape, len(xs)
    rs = [f.shape[1] for f in factors]
    R = sum(rs)
    if any(f.dim() != 2 or f.shape[0] != K for f in factors) or amax.shape != (R,) or \
            amax.dtype != torch.float32 or xs[0].dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"rows_narrow: sources {tuple(xs[0].shape)} {xs[0].dtype}, factors "
                         f"{[tuple(f.shape) for f in factors]}, amax {tuple(amax.shape)} {amax.dtype}; "
                         f"want [K, r] factors, [sum r] float32 maxima, bf16 or fp16 sources")
    xs = [x if x.stride(-1) == 1 else x.contiguous() for x in xs]
    factors = [f.to(xs[0].dtype) for f in factors]
    check_tensors("rows_narrow", *xs, *factors, amax)
    qw = n * K + slot_width(R)
    h = torch.empty((M, R), dtype=xs[0].dtype, device=xs[0].device)
    q = torch.empty((M, qw), dtype=torch.float8_e4m3fn, device=xs[0].device)
    s = torch.empty((M,), dtype=torch.float32, device=xs[0].device)
    if M:
        bm, bk, warps, programs = launch or narrow_launch(R)
        cs = xs[0] if col_scale is None else col_scale.float().contiguous()
        pad = 3 - n
        strides = [v for f in factors for v in f.stride()]
        blocks = triton.cdiv(M, bm)
        walk = 0 < programs < blocks
        _rows_narrow[(programs if walk else blocks,)](
            *xs, *xs[:1] * pad, *factors, *factors[:1] * pad, cs, amax, h, q, s, M, K, R, qw,
            *(x.stride(0) for x in xs), *[0] * pad, *strides, *[0, 0] * pad,
            rs[0], rs[1] if n > 1 else 0, NSRC=n, COLS=col_scale is not None,
            BM=bm, BK=bk, RP=max(16, triton.next_power_of_2(R)), WALK=walk, num_warps=warps)
    return h, q, s
