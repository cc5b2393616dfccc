"""Triton helpers of fp8 compute (``fp8_compute.py``): the row-wise e4m3 quantization of
activations and the transpose of weight codes.

- ``fp8_rows`` / ``fp8_rows_joined``: each row's amax, scale ``amax / 448``, and the row in
  float8_e4m3fn (each column first times its own factor where one is given: fp8 compute's
  input gradient); joined, one to three sources quantized as one row;
- ``transposed_codes``: [N, K] codes transposed side by side into [K, sum of N], the layout
  the input-gradient GEMM wants;
- ``lora_amax``, ``fp8_rows_joined`` with a tail, ``widened_codes``, ``transposed_codes``
  with a slot: a LoRA's products inside the fp8 GEMMs (``ops.fp8_lora_linears`` with
  ``full``): the up matrices' column maxima (g = amax / 448), the row ``[x | h g]`` under one
  scale, the codes widened by the up matrix's slot columns, and ``A^T / g'`` beside the
  transposed codes;
- ``slot_view``, ``filled_slots``: codes held with their slot columns already beside them
  (``quant.linear.QuantizedLinear.hold_slots``), only the slot written each forward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kohakumoss.kernels.triton_common import INTERPRETED, check_tensors, jit
from kohakumoss.quant.ops import slot_width

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
def _tail_part(H, A, row, R, tcols):
    """Row ``row`` of ``h * g`` (H [M, R] contiguous, ``g = A / 448``, A [R] float32), zero
    past R."""
    m = tcols < R
    g = tl.load(A + tcols, mask=m, other=0.0) / 448.0
    return tl.load(H + row * R + tcols, mask=m, other=0.0).to(tl.float32) * g


@jit
def _fp8_row(row, X0, X1, X2, CS, H, A, Q, S, K, R, QW, sx0, sx1, sx2, NSRC: tl.constexpr,
             COLS: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr):
    """One row of ``_fp8_rows``."""
    cols = tl.arange(0, BLOCK)
    out = Q + row * QW
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    if TAIL:
        tcols = tl.arange(0, TAIL)
        t = _tail_part(H, A, row, R, tcols)
        tmax = tl.max(tl.abs(t), axis=0)
    else:
        tmax = 0.0
    if K <= BLOCK:
        x0 = _row_part(X0 + row * sx0, CS, 0, 0, K, cols, COLS)
        amax = tl.abs(x0)
        if NSRC > 1:
            x1 = _row_part(X1 + row * sx1, CS, 1, 0, K, cols, COLS)
            amax = tl.maximum(amax, tl.abs(x1))
        if NSRC > 2:
            x2 = _row_part(X2 + row * sx2, CS, 2, 0, K, cols, COLS)
            amax = tl.maximum(amax, tl.abs(x2))
        s = tl.maximum(tl.max(amax, axis=0), tmax) / 448.0
        s = tl.where(s > 0.0, s, 1.0)
        m = cols < K
        tl.store(out + cols, _to_e4m3(tl.minimum(tl.maximum(x0 / s, -448.0), 448.0)), mask=m)
        if NSRC > 1:
            tl.store(out + K + cols, _to_e4m3(tl.minimum(tl.maximum(x1 / s, -448.0), 448.0)), mask=m)
        if NSRC > 2:
            tl.store(out + 2 * K + cols, _to_e4m3(tl.minimum(tl.maximum(x2 / s, -448.0), 448.0)), mask=m)
    else:
        for j in tl.static_range(NSRC):
            X = _row_source(j, X0, X1, X2) + row * _row_source(j, sx0, sx1, sx2)
            for k0 in range(0, K, BLOCK):
                amax = tl.maximum(amax, tl.abs(_row_part(X, CS, j, k0, K, cols, COLS)))
        s = tl.maximum(tl.max(amax, axis=0), tmax) / 448.0
        s = tl.where(s > 0.0, s, 1.0)
        for j in tl.static_range(NSRC):
            X = _row_source(j, X0, X1, X2) + row * _row_source(j, sx0, sx1, sx2)
            for k0 in range(0, K, BLOCK):
                q = tl.minimum(tl.maximum(_row_part(X, CS, j, k0, K, cols, COLS) / s, -448.0), 448.0)
                tl.store(out + j * K + k0 + cols, _to_e4m3(q), mask=(k0 + cols) < K)
    if TAIL:
        tq = _to_e4m3(tl.minimum(tl.maximum(t / s, -448.0), 448.0))
        tl.store(out + NSRC * K + tcols, tq, mask=NSRC * K + tcols < QW)
    tl.store(S + row, s)


@jit
def _fp8_rows(X0, X1, X2, CS, H, A, Q, S, M, K, R, QW, sx0, sx1, sx2, NSRC: tl.constexpr,
              COLS: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr, ROWS: tl.constexpr,
              STAGES: tl.constexpr):
    """Rows ``pid * ROWS ..`` of [X0 | X1 | X2][:, :NSRC * K] (each source K wide, its own row
    stride), each followed where ``TAIL`` (a power of two, 0 for none) by ``h * A / 448`` (R
    wide, zeros to TAIL), as e4m3 codes under one scale a row, into rows of Q (QW wide). A
    source that fits one block (``K <= BLOCK``) is read once and held in registers; a wider
    one is read twice. The rows are walked ``STAGES`` deep (the next one's loads in flight);
    past M the last row is done again (the same values)."""
    for i in tl.range(0, ROWS, num_stages=STAGES):
        row = tl.minimum(tl.program_id(0).to(tl.int64) * ROWS + i, M - 1)
        _fp8_row(row, X0, X1, X2, CS, H, A, Q, S, K, R, QW, sx0, sx1, sx2, NSRC, COLS, BLOCK, TAIL)


@jit
def _slot_amax(U0, U1, U2, S0, S1, S2, A, N, r0, r1, r2, NSRC: tl.constexpr, BN: tl.constexpr,
               BR: tl.constexpr):
    """``A[c_j + i] = max(A[c_j + i], max_n |U_j[n, i] / S_j[n]|)`` over this program's BN rows,
    for each of the NSRC sources U_j [N, r_j] (contiguous; their columns side by side in A
    from c_0 = 0). A is the float32 maxima's bits as int32: they are never negative, so the
    integers order as the floats do, and one atomic max a column merges the programs'."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rr = tl.arange(0, BR)
    c0 = 0
    for j in tl.static_range(NSRC):
        r = _row_source(j, r0, r1, r2)
        m = (rn[:, None] < N) & (rr[None, :] < r)
        u = tl.load(_row_source(j, U0, U1, U2) + rn.to(tl.int64)[:, None] * r + rr[None, :], mask=m,
                    other=0.0)
        u = tl.abs(u.to(tl.float32)) / tl.load(_row_source(j, S0, S1, S2) + rn, mask=rn < N, other=1.0)[:, None]
        tl.atomic_max(A + c0 + rr, tl.max(u, axis=0).to(tl.int32, bitcast=True), mask=rr < r)
        c0 += r


@jit
def _widen(C, UP, S, A, W, N, K, R, QW, c0, SK, su, sr, KC, HAS_S: tl.constexpr, BN: tl.constexpr,
           BK: tl.constexpr, BT: tl.constexpr, WIDTH: tl.constexpr):
    """Rows of W [N, QW] (bytes): the codes C [N, K] (bytes; K may be 0), then WIDTH columns
    from SK, zeros with the slot codes ``UP[n, j] / (S[n] g_j)`` in e4m3 at columns ``SK +
    c0 + j`` (UP [N, R], its rows ``su`` apart, its columns ``sr``; S 1 without ``HAS_S``;
    ``g = A / 448``, A the node's column maxima from ``_slot_amax``), BT at a time. Program
    (i, j) copies the codes' columns ``j KC ..`` of its BN rows; the programs of j = 0 write
    the slot."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rn64 = rn.to(tl.int64)
    mn = rn < N
    k_start = tl.program_id(1) * KC
    for k0 in range(k_start, tl.minimum(K, k_start + KC), BK):
        rk = k0 + tl.arange(0, BK)
        m = mn[:, None] & (rk[None, :] < K)
        c = tl.load(C + rn64[:, None] * K + rk[None, :], mask=m)
        tl.store(W + rn64[:, None] * QW + rk[None, :], c, mask=m)
    if tl.program_id(1) == 0:
        if HAS_S:
            s = tl.load(S + rn, mask=mn, other=1.0)
        else:
            s = tl.full((BN,), 1.0, tl.float32)
        for t0 in tl.static_range(0, WIDTH, BT):
            tc = t0 + tl.arange(0, BT)
            j = tc - c0
            mj = (j >= 0) & (j < R)
            u = tl.load(UP + rn64[:, None] * su + j[None, :] * sr, mask=mn[:, None] & mj[None, :], other=0.0)
            g = tl.load(A + c0 + j, mask=mj, other=0.0) / 448.0
            d = s[:, None] * g[None, :]
            q = tl.where(g[None, :] > 0.0, u.to(tl.float32) / tl.where(d > 0.0, d, 1.0), 0.0)
            q = _to_e4m3(tl.minimum(tl.maximum(q, -448.0), 448.0)).to(tl.uint8, bitcast=True)
            tl.store(W + rn64[:, None] * QW + SK + tc[None, :], q, mask=mn[:, None] & (tc[None, :] < WIDTH))


@jit
def _transpose(A, B, N, K, sa, sb, BN: tl.constexpr, BK: tl.constexpr):
    """``B[k, n] = A[n, k]``: A [N, K] with rows ``sa`` apart, B's rows ``sb`` apart (bytes as
    uint8)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    m = (rn[:, None] < N) & (rk[None, :] < K)
    a = tl.load(A + rn.to(tl.int64)[:, None] * sa + rk[None, :], mask=m, other=0)
    tl.store(B + rk.to(tl.int64)[:, None] * sb + rn[None, :], tl.trans(a), mask=tl.trans(m))


def fp8_rows(x: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.fp8_rows`` in Triton: one program per row (amax, then the codes); with
    ``col_scale`` [K] (fp32) the rows of ``x * col_scale`` (the product in fp32)."""
    return fp8_rows_joined([x], col_scale)


def fp8_rows_joined(xs: list[torch.Tensor], col_scale: torch.Tensor | None = None,
                    tail: tuple[torch.Tensor, torch.Tensor] | None = None,
                    launch: tuple[int, int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.fp8_rows(torch.cat(xs, 1), col_scale)`` without the concatenation: one to three
    [M, K] sources (rows contiguous, any row stride), each row quantized under one scale
    across all of them (fp8 compute's input gradient of q, k and v: one GEMM). ``tail = (h,
    amax)``: the row goes on with ``h * (amax / 448)`` (h [M, R], amax [R] float32 from
    ``lora_amax``), zero columns padding it by ``slot_width(R)`` (a LoRA's product inside the
    fp8 GEMM, ``ops.fp8_lora_linears`` with ``full``). ``launch``: ``rows_launch``'s
    answer given instead (``bench/bench_fp8_rows.py``'s sweep)."""
    if not 1 <= len(xs) <= 3 or any(x.shape != xs[0].shape or x.dim() != 2 for x in xs):
        raise ValueError(f"fp8_rows: one to three 2-D sources of one shape, got "
                         f"{[tuple(x.shape) for x in xs]}")
    xs = [x if x.stride(-1) == 1 else x.contiguous() for x in xs]
    check_tensors("fp8_rows", *xs)
    (M, K), n = xs[0].shape, len(xs)
    h, amax, R = xs[0], xs[0], 0
    if tail is not None:
        h, amax = tail[0].contiguous(), tail[1]
        R = h.shape[1]
        check_tensors("fp8_rows", h, amax)
        if h.shape[0] != M or amax.shape != (R,) or amax.dtype != torch.float32:
            raise ValueError(f"fp8_rows: sources {tuple(xs[0].shape)}, tail {tuple(h.shape)}, amax "
                             f"{tuple(amax.shape)} {amax.dtype}")
    qw = n * K + (slot_width(R) if tail is not None else 0)
    q = torch.empty((M, qw), dtype=torch.float8_e4m3fn, device=xs[0].device)
    s = torch.empty((M,), dtype=torch.float32, device=xs[0].device)
    if M and qw:
        block, rows, stages, warps = launch or rows_launch(K, n)
        cs = xs[0] if col_scale is None else col_scale.float().contiguous()
        src = [*xs, xs[0], xs[0]][:3]
        _fp8_rows[(triton.cdiv(M, rows),)](
            *src, cs, h, amax, q, s, M, K, R, qw, *(x.stride(0) for x in src), NSRC=n,
            COLS=col_scale is not None, BLOCK=block, TAIL=triton.next_power_of_2(qw - n * K) if tail is not None else 0,
            ROWS=rows, STAGES=stages, num_warps=warps)
    return q, s


def rows_launch(K: int, n: int) -> tuple[int, int, int, int]:
    """``_fp8_rows``' launch for n sources K wide: (block, rows a program walks, their
    stages, warps). A row up to 8192 wide per source is held in registers (read once);
    interpreted, rows up to 32 wide take that path and wider ones the two-pass loop over 16.
    One source up to 8192 wide runs fastest with 4 warps, three sources with 8
    (``bench/bench_fp8_rows.py`` on the H200: ffn_down's 8,192-wide input 108 us in
    registers against 125 us over 2048-wide blocks; docs/performance.md)."""
    wide = 32 if INTERPRETED else 8192
    block = triton.next_power_of_2(K) if K <= wide else (16 if INTERPRETED else 2048)
    return block, 1, 1, 8 if n > 1 or K > wide else 4


def lora_amax(ups: list[torch.Tensor], scales: list[torch.Tensor]) -> torch.Tensor:
    """The column maxima ``max_n |up[n, j] / s_n|`` of one to three up matrices [N, r_i] of
    one N (``scales`` [N] each) side by side, float32 [sum of r]: ``g = amax / 448`` is
    ``ops.fp8_lora_slots``'s, bit for bit. One launch: a program per block of rows, merged by
    atomic maxima."""
    N = ups[0].shape[0]
    if not 1 <= len(ups) <= 3 or any(u.dim() != 2 or u.shape[0] != N for u in ups):
        raise ValueError(f"lora_amax: one to three up matrices of one height, got "
                         f"{[tuple(u.shape) for u in ups]}")
    ups = [u.contiguous() for u in ups]
    ss = [s.float().contiguous() for s in scales]
    check_tensors("lora_amax", *ups, *ss)
    if any(s.shape != (N,) for s in ss):
        raise ValueError(f"lora_amax: up matrices of {N} rows, scales {[tuple(s.shape) for s in ss]}")
    rs = [u.shape[1] for u in ups]
    out = torch.zeros((sum(rs),), dtype=torch.float32, device=ups[0].device)
    br = triton.next_power_of_2(max(rs))
    bn = 16 if INTERPRETED else max(16, min(256, 8192 // br))
    if N:
        pad = 3 - len(ups)
        _slot_amax[(triton.cdiv(N, bn),)](*ups, *ups[:1] * pad, *ss, *ss[:1] * pad, out.view(torch.int32),
                                          N, *rs, *[0] * pad, NSRC=len(ups), BN=bn, BR=br, num_warps=4)
    return out


def _slots(out: torch.Tensor, codes: torch.Tensor | None, up: torch.Tensor, scale: torch.Tensor | None,
           amax: torch.Tensor, c0: int, col: int, width: int) -> torch.Tensor:
    """Rows of ``out`` [N, QW]: ``codes`` [N, K] copied to columns 0..K (where given), then
    columns ``col .. col + width`` zero but for the slot codes of ``up`` at ``col + c0``."""
    N, R = up.shape
    K = 0 if codes is None else codes.shape[1]
    if amax.numel() < c0 + R or c0 + R > width or width % 16 or col + width > out.shape[1] or \
            out.shape[0] != N or (codes is not None and codes.shape[0] != N):
        raise ValueError(f"fp8 LoRA slot: up {tuple(up.shape)}, columns {c0}..{c0 + R} of {width} "
                         f"from {col} in {tuple(out.shape)}")
    # the copy split along K into chunks of 4 x 256 columns (interpreted: 2 x 16), so that a
    # 3,072-row linear's codes are spread over more programs than its 96 row blocks
    bn, bk = (16, 16) if INTERPRETED else (32, 256)
    kc = 2 * bk if INTERPRETED else 4 * bk
    c = out if codes is None else codes.contiguous()
    s = up if scale is None else scale.float().contiguous()
    if N:
        grid = (triton.cdiv(N, bn), max(1, triton.cdiv(K, kc)))
        _widen[grid](c.view(torch.uint8), up, s, amax, out.view(torch.uint8), N, K, R, out.stride(0), c0, col,
                     up.stride(0), up.stride(1), kc, HAS_S=scale is not None, BN=bn, BK=bk,
                     BT=min(64, triton.next_power_of_2(width)), WIDTH=width, num_warps=4)
    return out


def widened_codes(codes: torch.Tensor, up: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                  c0: int, width: int) -> torch.Tensor:
    """[N, K + width] float8_e4m3fn: the codes, then ``width`` slot columns, zero but for
    ``ops.fp8_lora_slots(up, scale)[1]`` at ``c0`` (``amax``: the node's ``lora_amax``, this
    LoRA's r columns from ``c0``)."""
    N, K = codes.shape
    out = torch.empty((N, K + width), dtype=codes.dtype, device=codes.device)
    return _slots(out, codes, up, scale, amax, c0, K, width)


def slot_view(codes: torch.Tensor, width: int) -> torch.Tensor | None:
    """The [N, K + width] matrix whose first K columns ``codes`` [N, K] are, where the codes
    are held that way (``QuantizedLinear.hold_slots``: rows K + width apart, room for the last
    row's slot), else None."""
    N, K = codes.shape
    if codes.stride() != (K + width, 1) or N == 0 or \
            codes.untyped_storage().nbytes() < (codes.storage_offset() + N * (K + width)) * codes.element_size():
        return None
    return codes.as_strided((N, K + width), (K + width, 1))


def filled_slots(wide: torch.Tensor, up: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                 c0: int, width: int) -> torch.Tensor:
    """``widened_codes`` in place: the last ``width`` columns of ``wide`` [N, K + width]
    (``slot_view``'s) written as that function writes them, the codes before them left as
    they are (one pass over ``N x width`` bytes, not a copy of the codes)."""
    return _slots(wide, None, up, scale, amax, c0, wide.shape[1] - width, width)


def transposed_codes(codes: list[torch.Tensor], slot: tuple[torch.Tensor, torch.Tensor] | None = None,
                     held: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.cat([c.t() for c in codes], 1).contiguous()``: [K, sum of N], each [N, K]
    code matrix's transpose side by side, by a tiled kernel on the bytes (torch's own copy
    of a one-byte transpose runs at a fraction of the memory's speed). ``slot = (down,
    amax)``: ``slot_width(R)`` more columns, ``ops.fp8_lora_slots(down^T, ones)[1]`` and
    zeros (down [R, K]; amax its rows' maxima of |down|): the LoRAs' ``t down``
    inside the input-gradient GEMM. ``held``: a [K, sum of N + slot] buffer that holds these
    transposes already (kept between steps, ``QuantizedLinear.node_transposes``): only its
    slot is written, and it is returned."""
    K = codes[0].shape[1]
    if any(c.dim() != 2 or c.shape[1] != K or c.dtype != codes[0].dtype for c in codes):
        raise ValueError("transposed_codes: [N, K] codes of one K and dtype")
    total = sum(c.shape[0] for c in codes)
    width = 0 if slot is None else slot_width(slot[0].shape[0])
    if held is not None:
        if held.shape != (K, total + width) or held.dtype != codes[0].dtype or not held.is_contiguous():
            raise ValueError(f"transposed_codes: held {tuple(held.shape)} {held.dtype}, want "
                             f"({K}, {total + width}) {codes[0].dtype}, contiguous")
        return held if slot is None else _slots(held, None, slot[0].t(), None, slot[1], 0, total, width)
    out = torch.empty((K, total + width), dtype=codes[0].dtype, device=codes[0].device)
    bn, bk = (16, 16) if INTERPRETED else (64, 64)
    col = 0
    for c in codes:
        N = c.shape[0]
        if N and K:  # rows of codes held with their slot columns (``slot_view``) read in place
            a = (c if c.stride(1) == 1 else c.contiguous()).view(torch.uint8)
            _transpose[(triton.cdiv(N, bn), triton.cdiv(K, bk))](
                a, out.view(torch.uint8)[:, col:], N, K, a.stride(0), total + width, BN=bn, BK=bk,
                num_warps=4)
        col += N
    if slot is not None:
        _slots(out, None, slot[0].t(), None, slot[1], 0, total, width)
    return out
