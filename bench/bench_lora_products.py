"""The LoRA's narrow products at the real model's sizes, in each operand layout cuBLAS can
be asked for. (GPU, not a test.)

    PYTHONPATH=. python bench/bench_lora_products.py [--tokens 16794] [--rank 32]

A rank-32 LoRA on every linear of a block adds narrow products to its step: ``h = x A^T``
(forward), ``t = dy B``, ``dB = dy^T h`` and ``dA = t^T x`` (backward). Each reads one whole
activation or gradient ([tokens, 3,072-16,384] bf16) and so is bound by memory. The
eleventh pass's profile put them at 39.6 ms a 16,800-token step, some at about half the
memory's speed (``t`` at 3,072 wide: 49 µs for 103 MB). Asked as the transposed product
(``(B^T dy^T)^T``) cuBLAS picks other tiles; and ``h`` and ``t`` (a narrow output, the
long side summed in one program) by a Triton kernel written here as a candidate: each
program streams ``BM`` whole rows of the big operand through ``tl.dot`` against the narrow
factor (read from L2), in ``STAGES`` pipelined steps. This times every form of each product
(CUDA events, ``_report.cuda_ms``) with the bytes read over the time, and the error against
the first form. Prints one JSON object (``$OUT/bench_lora_products.json`` on the device
machine).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from _report import cuda_ms, report  # bench/_report.py (the script's folder is on sys.path)


@triton.jit
def _narrow(X, W, C, M, K, R, sxm, swk, swr, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
            STAGES: tl.constexpr):
    """C[m, :R] = X[m, :] W for BM rows m (X [M, K] row-major; W [K, R] at strides swk, swr;
    C [M, R] contiguous), fp32 accumulation, one rounding to C's dtype."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rr = tl.arange(0, BR)
    acc = tl.zeros((BM, BR), tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        rk = k0 + tl.arange(0, BK)
        x = tl.load(X + rm.to(tl.int64)[:, None] * sxm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                    other=0.0)
        w = tl.load(W + rk[:, None] * swk + rr[None, :] * swr, mask=(rk[:, None] < K) & (rr[None, :] < R),
                    other=0.0)
        acc = tl.dot(x, w, acc)
    tl.store(C + rm.to(tl.int64)[:, None] * R + rr[None, :], acc.to(C.dtype.element_ty),
             mask=(rm[:, None] < M) & (rr[None, :] < R))


def narrow(x: torch.Tensor, w: torch.Tensor, bm: int = 128, bk: int = 64, stages: int = 4,
           warps: int = 4) -> torch.Tensor:
    """``x @ w`` for x [M, K] row-major and a narrow w [K, R] (any strides) by ``_narrow``."""
    M, K = x.shape
    R = w.shape[1]
    c = torch.empty((M, R), dtype=x.dtype, device=x.device)
    _narrow[(triton.cdiv(M, bm),)](x, w, c, M, K, R, x.stride(0), w.stride(0), w.stride(1), BM=bm, BK=bk,
                                   BR=max(16, triton.next_power_of_2(R)), STAGES=stages, num_warps=warps)
    return c


TRITON_CONFIGS = ((128, 64, 4, 4), (128, 128, 3, 8), (64, 128, 4, 4), (256, 64, 3, 8))
"""(rows a program, K step, stages, warps) of the ``_narrow`` candidate."""


def forms(big: torch.Tensor, small: torch.Tensor, kind: str):
    """(name, fn) pairs computing one product two ways. ``big`` [M, W] (x or dy), ``small``
    the factor or the narrow activation."""
    if kind == "h":  # x [M, K] A^T, A [r, K] -> [M, r]
        return [("x @ A^T", lambda: torch.mm(big, small.t())),
                ("(A @ x^T)^T", lambda: torch.mm(small, big.t()).t()),
                *((f"triton {c}", lambda c=c: narrow(big, small.t(), *c)) for c in TRITON_CONFIGS)]
    if kind == "t":  # dy [M, N] B, B [N, r] -> [M, r]
        return [("dy @ B", lambda: torch.mm(big, small)),
                ("(B^T @ dy^T)^T", lambda: torch.mm(small.t(), big.t()).t()),
                *((f"triton {c}", lambda c=c: narrow(big, small, *c)) for c in TRITON_CONFIGS)]
    if kind == "dB":  # dy^T h, h [M, r] -> [N, r]
        return [("dy^T @ h", lambda: torch.mm(big.t(), small)),
                ("(h^T @ dy)^T", lambda: torch.mm(small.t(), big).t())]
    # dA: t^T x, t [M, r] -> [r, K]
    return [("t^T @ x", lambda: torch.mm(small.t(), big)),
            ("(x^T @ t)^T", lambda: torch.mm(big.t(), small).t())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16794)
    ap.add_argument("--rank", type=int, default=32)
    a = ap.parse_args()
    dev, g = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    M, r = a.tokens, a.rank
    out = {"device": torch.cuda.get_device_name(), "tokens": M, "rank": r, "products": []}

    def rand(*shape):
        return torch.randn(*shape, device=dev, generator=g, dtype=torch.bfloat16)

    # (product, width of the big operand, rank): q|k|v's down is 3 r wide
    cases = [("h", 3072, 3 * r), ("h", 3072, r), ("h", 8192, r), ("t", 3072, r), ("t", 16384, r),
             ("dB", 3072, r), ("dB", 16384, r), ("dA", 3072, 3 * r), ("dA", 3072, r), ("dA", 8192, r)]
    for kind, W, rr in cases:
        big = rand(M, W)
        small = {"h": rand(rr, W), "t": rand(W, rr)}.get(kind, rand(M, rr))
        row = {"product": kind, "width": W, "rank": rr}
        ref = None
        for name, fn in forms(big, small, kind):
            try:
                got = fn()
            except Exception as e:  # a candidate config that does not build
                row[name] = f"{type(e).__name__}: {str(e)[:100]}"
                continue
            ref = got if ref is None else ref
            ms = cuda_ms(fn, reps=10, iters=9)
            row[name] = {"us": round(ms * 1e3, 1), "tb_s": round(big.numel() * 2 / ms / 1e9, 2),
                         "rel": float((got.float() - ref.float()).norm() / ref.float().norm())}
        out["products"].append(row)
        print(row, flush=True)
    report(out, "bench_lora_products")


if __name__ == "__main__":
    main()
