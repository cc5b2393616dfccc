"""TileLang kernels (``tilelang.language`` programs) behind the ``tilelang`` backend
(``kohakumoss.experimental.tilelang.ops``): RMSNorm and modulated RMSNorm (forward, input
gradient), SiTU on the packed up|gate output (forward, backward), the gated residual add
(forward, gated input's gradient) and varlen attention (forward with its log-sum-exp, and
backward). Math in fp32 registers, one rounding out; attention's two products per tile run on
the tensor cores with fp32 accumulation (the P and dS tiles rounded to the input dtype for
them, as every flash attention does).

Each builder returns a ``T.prim_func`` for the static sizes (feature width, heads, head dim,
the activations' dtype, those of the norm weight, modulation and gate, tile sizes); token
and sample counts are dynamic, so one compiled kernel serves every batch of a run.
Importing this module imports TileLang.

Legend: N tokens, D features, F SiTU's output width (its input holds 2F), B samples, S
segments, H heads, Dh head dim, BM x BN attention's query x key tile.
"""


import tilelang.language as T

LOG2E = 1.4426950408889634
# the dynamic sizes, module globals so that a kernel's signature sees them (a closure holds
# only the names its body reads)
N, B, S = T.dynamic("N"), T.dynamic("B"), T.dynamic("S")
I32, I64, F32 = "int32", "int64", "float32"  # dtype names (a string in a signature reads as a
# forward reference to linters)


def norm_forward(D: int, dtype: str, wdtype: str, mdtype: str, modulated: bool, threads: int = 256):
    """``out = rms_norm(x) w [(1 + scale[seg]) + shift[seg]]``, one row per block."""
    @T.prim_func
    def kernel(X: T.Tensor((N, D), dtype), W: T.Tensor((D,), wdtype), SH: T.Tensor((B, D), mdtype),
               SC: T.Tensor((B, D), mdtype), SEG: T.Tensor((N,), I64), OUT: T.Tensor((N, D), dtype),
               eps: T.float32):
        with T.Kernel(N, threads=threads) as row:
            x = T.alloc_fragment((D,), "float32")
            sq = T.alloc_fragment((D,), "float32")
            ss = T.alloc_fragment((1,), "float32")
            for j in T.Parallel(D):
                x[j] = T.cast(X[row, j], "float32")
                sq[j] = x[j] * x[j]
            T.reduce_sum(sq, ss, dim=0)
            for j in T.Parallel(D):
                y = x[j] * T.rsqrt(ss[0] / D + eps) * T.cast(W[j], "float32")
                if modulated:
                    s = SEG[row]
                    y = y * (1.0 + T.cast(SC[s, j], "float32")) + T.cast(SH[s, j], "float32")
                OUT[row, j] = T.cast(y, dtype)

    return kernel


def norm_backward(D: int, dtype: str, wdtype: str, mdtype: str, modulated: bool, threads: int = 256):
    """``dx = r (gy w - xh mean(gy w xh))`` with ``gy = g (1 + scale[seg])``, one row per block."""
    @T.prim_func
    def kernel(G: T.Tensor((N, D), dtype), X: T.Tensor((N, D), dtype), W: T.Tensor((D,), wdtype),
               SC: T.Tensor((B, D), mdtype), SEG: T.Tensor((N,), I64), DX: T.Tensor((N, D), dtype),
               eps: T.float32):
        with T.Kernel(N, threads=threads) as row:
            x = T.alloc_fragment((D,), "float32")
            gw = T.alloc_fragment((D,), "float32")
            sq = T.alloc_fragment((D,), "float32")
            dot = T.alloc_fragment((D,), "float32")
            ss = T.alloc_fragment((1,), "float32")
            sd = T.alloc_fragment((1,), "float32")
            for j in T.Parallel(D):
                x[j] = T.cast(X[row, j], "float32")
                g = T.cast(G[row, j], "float32")
                if modulated:
                    g = g * (1.0 + T.cast(SC[SEG[row], j], "float32"))
                gw[j] = g * T.cast(W[j], "float32")
                sq[j] = x[j] * x[j]
                dot[j] = gw[j] * x[j]
            T.reduce_sum(sq, ss, dim=0)
            T.reduce_sum(dot, sd, dim=0)
            for j in T.Parallel(D):
                r = T.rsqrt(ss[0] / D + eps)
                # mean(gw xh) = r mean(gw x)
                DX[row, j] = T.cast(r * (gw[j] - x[j] * r * r * (sd[0] / D)), dtype)

    return kernel


def _situ_parts(u, g):
    """tanh(u/25), tanh(g/4), sigmoid(g) in fp32."""
    return T.tanh(u * 0.04), T.tanh(g * 0.25), 1.0 / (1.0 + T.exp(-g))


def situ_forward(F: int, dtype: str, rows: int = 2, threads: int = 256):
    """``out = 4 tanh(g/4) sigmoid(g) 25 tanh(u/25)`` with u, g the halves of one [N, 2F] row."""
    @T.prim_func
    def kernel(UG: T.Tensor((N, 2 * F), dtype), OUT: T.Tensor((N, F), dtype)):
        with T.Kernel(T.ceildiv(N, rows), threads=threads) as bx:
            for i, j in T.Parallel(rows, F):
                r = bx * rows + i
                if r < N:
                    tu, tg, sig = _situ_parts(T.cast(UG[r, j], "float32"), T.cast(UG[r, F + j], "float32"))
                    OUT[r, j] = T.cast(4.0 * tg * sig * 25.0 * tu, dtype)

    return kernel


def situ_backward(F: int, dtype: str, rows: int = 2, threads: int = 256):
    """``du = go A (1 - tanh(u/25)^2)``, ``dg = go U ((1 - tanh(g/4)^2) sig + 4 tanh(g/4) sig
    (1 - sig))``, written as the halves of one [N, 2F] gradient."""
    @T.prim_func
    def kernel(GO: T.Tensor((N, F), dtype), UG: T.Tensor((N, 2 * F), dtype),
               DUG: T.Tensor((N, 2 * F), dtype)):
        with T.Kernel(T.ceildiv(N, rows), threads=threads) as bx:
            for i, j in T.Parallel(rows, F):
                r = bx * rows + i
                if r < N:
                    go = T.cast(GO[r, j], "float32")
                    tu, tg, sig = _situ_parts(T.cast(UG[r, j], "float32"), T.cast(UG[r, F + j], "float32"))
                    DUG[r, j] = T.cast(go * 4.0 * tg * sig * (1.0 - tu * tu), dtype)
                    dgate = (1.0 - tg * tg) * sig + 4.0 * tg * sig * (1.0 - sig)
                    DUG[r, F + j] = T.cast(go * 25.0 * tu * dgate, dtype)

    return kernel


def gated_residual_forward(D: int, dtype: str, pdtype: str, rows: int = 2, threads: int = 256):
    """``out = x + gate[seg] y`` (mode "forward"), fp32 inside."""
    @T.prim_func
    def kernel(X: T.Tensor((N, D), dtype), Y: T.Tensor((N, D), dtype), GATE: T.Tensor((B, D), pdtype),
               SEG: T.Tensor((N,), I64), OUT: T.Tensor((N, D), dtype)):
        with T.Kernel(T.ceildiv(N, rows), threads=threads) as bx:
            for i, j in T.Parallel(rows, D):
                r = bx * rows + i
                if r < N:
                    gate = T.cast(GATE[SEG[r], j], "float32")
                    OUT[r, j] = T.cast(T.cast(X[r, j], "float32") + gate * T.cast(Y[r, j], "float32"), dtype)

    return kernel


def gated_gradient(D: int, dtype: str, pdtype: str, rows: int = 2, threads: int = 256):
    """``dy = gate[seg] go``."""
    @T.prim_func
    def kernel(GO: T.Tensor((N, D), dtype), GATE: T.Tensor((B, D), pdtype), SEG: T.Tensor((N,), I64),
               DY: T.Tensor((N, D), dtype)):
        with T.Kernel(T.ceildiv(N, rows), threads=threads) as bx:
            for i, j in T.Parallel(rows, D):
                r = bx * rows + i
                if r < N:
                    DY[r, j] = T.cast(T.cast(GATE[SEG[r], j], "float32") * T.cast(GO[r, j], "float32"), dtype)

    return kernel


def attention_forward(H: int, Dh: int, dtype: str, BM: int = 128, BN: int = 128, stages: int = 2,
                      threads: int = 256):
    """Flash attention over packed segments: block (query tile, head, segment); keys of the
    segment in BN tiles with an online softmax in the log2 domain. Writes O and LSE2 (the
    rows' log2-sum-exp2 of the scaled scores), which backward reads.

    Tiles are whole-tile copies (TMA / ``cp.async``, pipelined over ``stages``): a tile past
    its segment reads the next one's rows (masked out: -inf scores, so P = 0 there) and past
    the last token zeros; P stays in registers for its product with V."""
    scale = LOG2E / Dh ** 0.5

    @T.prim_func
    def kernel(Q: T.Tensor((N, H, Dh), dtype), K: T.Tensor((N, H, Dh), dtype), V: T.Tensor((N, H, Dh), dtype),
               CU: T.Tensor((S + 1,), I32), O: T.Tensor((N, H, Dh), dtype),
               LSE: T.Tensor((N, H), F32),
               tiles: T.int32):
        with T.Kernel(tiles, H, S, threads=threads) as (bx, head, seg):
            q_s = T.alloc_shared((BM, Dh), dtype)
            k_s = T.alloc_shared((BN, Dh), dtype)
            v_s = T.alloc_shared((BN, Dh), dtype)
            acc = T.alloc_fragment((BM, Dh), "float32")
            s = T.alloc_fragment((BM, BN), "float32")
            p = T.alloc_fragment((BM, BN), dtype)
            m = T.alloc_fragment((BM,), "float32")
            m_prev = T.alloc_fragment((BM,), "float32")
            l = T.alloc_fragment((BM,), "float32")
            l_tile = T.alloc_fragment((BM,), "float32")
            start = CU[seg]
            L = CU[seg + 1] - start
            q0 = bx * BM
            T.copy(Q[start + q0:start + q0 + BM, head, 0:Dh], q_s)
            T.clear(acc)
            T.fill(m, -T.infinity("float32"))
            T.clear(l)
            for kb in T.Pipelined(T.ceildiv(L, BN) * T.if_then_else(q0 < L, 1, 0), num_stages=stages):
                T.copy(K[start + kb * BN:start + kb * BN + BN, head, :], k_s)
                T.copy(V[start + kb * BN:start + kb * BN + BN, head, :], v_s)
                T.clear(s)
                T.gemm(q_s, k_s, s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(BM, BN):
                    s[i, j] = T.if_then_else(kb * BN + j < L, s[i, j] * scale, -T.infinity("float32"))
                T.copy(m, m_prev)
                T.reduce_max(s, m, dim=1, clear=False)
                for i, j in T.Parallel(BM, BN):
                    s[i, j] = T.exp2(s[i, j] - m[i])
                T.reduce_sum(s, l_tile, dim=1)
                for i in T.Parallel(BM):
                    l[i] = l[i] * T.exp2(m_prev[i] - m[i]) + l_tile[i]
                for i, d in T.Parallel(BM, Dh):
                    acc[i, d] = acc[i, d] * T.exp2(m_prev[i] - m[i])
                T.copy(s, p)
                T.gemm(p, v_s, acc, policy=T.GemmWarpPolicy.FullRow)
            for i, d in T.Parallel(BM, Dh):
                if q0 + i < L:
                    O[start + q0 + i, head, d] = T.cast(acc[i, d] / l[i], dtype)
            for i in T.Parallel(BM):
                if q0 + i < L:
                    LSE[start + q0 + i, head] = m[i] + T.log2(l[i])

    return kernel


def attention_backward(H: int, Dh: int, dtype: str, BM: int = 64, BN: int = 64, stages: int = 2,
                       threads: int = 256):
    """Block (key tile, head, segment): walks the segment's query tiles, accumulates dK and dV
    in registers, adds dQ (fp32, pre-scaled) atomically into DQ. ``DELTA = rowsum(dO O)``.
    Whole-tile copies as in the forward; P is zeroed outside the segment's keys and queries,
    which zeroes every product those rows would enter."""
    scale = 1.0 / Dh ** 0.5

    @T.prim_func
    def kernel(Q: T.Tensor((N, H, Dh), dtype), K: T.Tensor((N, H, Dh), dtype), V: T.Tensor((N, H, Dh), dtype),
               DO: T.Tensor((N, H, Dh), dtype), LSE: T.Tensor((N, H), F32),
               DELTA: T.Tensor((N, H), F32), CU: T.Tensor((S + 1,), I32),
               DQ: T.Tensor((N, H, Dh), F32), DK: T.Tensor((N, H, Dh), dtype),
               DV: T.Tensor((N, H, Dh), dtype), tiles: T.int32):
        with T.Kernel(tiles, H, S, threads=threads) as (bx, head, seg):
            k_s = T.alloc_shared((BN, Dh), dtype)
            v_s = T.alloc_shared((BN, Dh), dtype)
            q_s = T.alloc_shared((BM, Dh), dtype)
            do_s = T.alloc_shared((BM, Dh), dtype)
            lse_s = T.alloc_shared((BM,), "float32")
            delta_s = T.alloc_shared((BM,), "float32")
            pt_s = T.alloc_shared((BN, BM), dtype)
            dst_s = T.alloc_shared((BN, BM), dtype)
            st = T.alloc_fragment((BN, BM), "float32")
            dpt = T.alloc_fragment((BN, BM), "float32")
            dk = T.alloc_fragment((BN, Dh), "float32")
            dv = T.alloc_fragment((BN, Dh), "float32")
            dq = T.alloc_fragment((BM, Dh), "float32")
            start = CU[seg]
            L = CU[seg + 1] - start
            k0 = bx * BN
            T.copy(K[start + k0:start + k0 + BN, head, :], k_s)
            T.copy(V[start + k0:start + k0 + BN, head, :], v_s)
            T.clear(dk)
            T.clear(dv)
            for qb in T.Pipelined(T.ceildiv(L, BM) * T.if_then_else(k0 < L, 1, 0), num_stages=stages):
                T.copy(Q[start + qb * BM:start + qb * BM + BM, head, :], q_s)
                T.copy(DO[start + qb * BM:start + qb * BM + BM, head, :], do_s)
                for i in T.Parallel(BM):
                    row = T.min(qb * BM + i, L - 1)
                    lse_s[i] = LSE[start + row, head]
                    delta_s[i] = DELTA[start + row, head]
                T.clear(st)
                T.gemm(k_s, q_s, st, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for j, i in T.Parallel(BN, BM):  # P^T; keys and queries past the segment: 0
                    st[j, i] = T.if_then_else((k0 + j < L) & (qb * BM + i < L),
                                              T.exp2(st[j, i] * (scale * LOG2E) - lse_s[i]), 0)
                T.clear(dpt)
                T.gemm(v_s, do_s, dpt, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.copy(st, pt_s)
                T.gemm(pt_s, do_s, dv, policy=T.GemmWarpPolicy.FullRow)
                for j, i in T.Parallel(BN, BM):  # dS^T
                    dpt[j, i] = st[j, i] * (dpt[j, i] - delta_s[i])
                T.copy(dpt, dst_s)
                T.gemm(dst_s, q_s, dk, policy=T.GemmWarpPolicy.FullRow)
                T.clear(dq)
                T.gemm(dst_s, k_s, dq, transpose_A=True, policy=T.GemmWarpPolicy.FullRow)
                for i, d in T.Parallel(BM, Dh):
                    if qb * BM + i < L:
                        T.atomic_add(DQ[start + qb * BM + i, head, d], dq[i, d] * scale)
            for j, d in T.Parallel(BN, Dh):
                if k0 + j < L:
                    DK[start + k0 + j, head, d] = T.cast(dk[j, d] * scale, dtype)
                    DV[start + k0 + j, head, d] = T.cast(dv[j, d], dtype)

    return kernel
