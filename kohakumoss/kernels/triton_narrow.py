"""A Triton kernel for the LoRA's narrow-output products (``kernels/narrow.py``): ``x @ w``
for a tall x [M, K] (an activation or its gradient, thousands of rows) and a narrow w [K, R]
(a LoRA factor, R the rank). Such a product reads all of x once and is bound by memory;
each program streams BM whole rows of x through ``tl.dot`` against w (read from L2), in
pipelined K steps, fp32 sums, one rounding out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kohakumoss.kernels.triton_common import INTERPRETED, check_tensors, jit

_INTERPRETED = tl.constexpr(INTERPRETED)


@jit
def _narrow(X, W, C, M, K, R, sxm, swk, swr, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
            STAGES: tl.constexpr):
    """``C[m, :R] = X[m, :] W`` for this program's BM rows m (X [M, K], rows ``sxm`` apart;
    W [K, R] at strides ``swk``, ``swr``; C [M, R] contiguous)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rr = tl.arange(0, BR)
    mm = rm[:, None] < M
    acc = tl.zeros((BM, BR), tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        rk = k0 + tl.arange(0, BK)
        x = tl.load(X + rm.to(tl.int64)[:, None] * sxm + rk[None, :], mask=mm & (rk[None, :] < K), other=0.0)
        w = tl.load(W + rk[:, None] * swk + rr[None, :] * swr, mask=(rk[:, None] < K) & (rr[None, :] < R),
                    other=0.0)
        if _INTERPRETED:  # the interpreter's half-precision dot is wrong (triton_quant._mma)
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    tl.store(C + rm.to(tl.int64)[:, None] * R + rr[None, :], acc.to(C.dtype.element_ty),
             mask=mm & (rr[None, :] < R))


LAUNCH = (128, 64, 4, 4)
"""(rows a program, K step, stages, warps): ``bench/bench_lora_products.py``'s candidates."""


def narrow_mm(x: torch.Tensor, w: torch.Tensor, launch: tuple[int, int, int, int] | None = None
              ) -> torch.Tensor:
    """``x @ w`` [M, R] for x [M, K] (rows contiguous) and w [K, R] (any strides), R <= 256,
    bf16 or fp16 (interpreted: also fp32). ``launch``: ``LAUNCH``'s fields given instead
    (``bench/bench_lora_products.py``'s candidates)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[0] or w.shape[1] > 256 or x.dtype != w.dtype:
        raise ValueError(f"narrow_mm: x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}; "
                         f"want [M, K] @ [K, R <= 256] of one dtype")
    x = x if x.stride(-1) == 1 else x.contiguous()
    check_tensors("narrow_mm", x, w)
    M, K = x.shape
    R = w.shape[1]
    c = torch.empty((M, R), dtype=x.dtype, device=x.device)
    bm, bk, stages, warps = launch or ((16, 16, 1, 4) if INTERPRETED else LAUNCH)
    if M and R:
        _narrow[(triton.cdiv(M, bm),)](x, w, c, M, K, R, x.stride(0), w.stride(0), w.stride(1), BM=bm, BK=bk,
                                       BR=max(16, triton.next_power_of_2(R)), STAGES=stages, num_warps=warps)
    return c
