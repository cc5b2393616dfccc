"""The LoRA's narrow products at the real model's sizes, in each operand layout cuBLAS can
be asked for. (GPU, not a test.)

    PYTHONPATH=. python bench/bench_lora_products.py [--tokens 16794] [--rank 32]

A rank-32 LoRA on every linear of a block adds narrow products to its step: ``h = x A^T``
(forward), ``t = dy B``, ``dB = dy^T h`` and ``dA = t^T x`` (backward). Each reads one whole
activation or gradient ([tokens, 3,072-16,384] bf16) and so is bound by memory. A profile
of the 16,800-token step puts them at 39.6 ms, some at about half the
memory's speed (``t`` at 3,072 wide: 49 µs for 103 MB). Asked as the transposed product
(``(B^T dy^T)^T``) cuBLAS picks other tiles; and ``h`` and ``t`` (a narrow output, the
long side summed in one program) by ``kernels/triton_narrow.py`` in several launches
(``ops.narrow_mm``'s backends, ``kernels/narrow.py``, are the three ways in a step). This times every form of
each product (every form once a round, ``_report.rounds_ms``) with the bytes read over the time, and the
error against the first form. Prints one JSON object (``$OUT/bench_lora_products.json`` on the device
machine).
"""

from __future__ import annotations

import argparse

import torch

from kohakumoss.kernels.triton_narrow import narrow_mm
from _report import report, rounds_ms  # bench/_report.py (the script's folder is on sys.path)


TRITON_CONFIGS = ((128, 64, 4, 4), (128, 128, 3, 8), (64, 128, 4, 4), (256, 64, 3, 8), (64, 64, 6, 4))
"""(rows a program, K step, stages, warps) of ``triton_narrow``'s kernel (the first is its
``LAUNCH``)."""


def forms(big: torch.Tensor, small: torch.Tensor, kind: str):
    """(name, fn) pairs computing one product each way. ``big`` [M, W] (x or dy), ``small``
    the factor or the narrow activation."""
    if kind == "h":  # x [M, K] A^T, A [r, K] -> [M, r]
        return [("x @ A^T", lambda: torch.mm(big, small.t())),
                ("(A @ x^T)^T", lambda: torch.mm(small, big.t()).t()),
                *((f"triton {c}", lambda c=c: narrow_mm(big, small.t(), c)) for c in TRITON_CONFIGS)]
    if kind == "t":  # dy [M, N] B, B [N, r] -> [M, r]
        return [("dy @ B", lambda: torch.mm(big, small)),
                ("(B^T @ dy^T)^T", lambda: torch.mm(small.t(), big.t()).t()),
                *((f"triton {c}", lambda c=c: narrow_mm(big, small, c)) for c in TRITON_CONFIGS)]
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
        ref, fns, got = None, {}, {}
        for name, fn in forms(big, small, kind):
            try:
                got[name] = fn()
            except Exception as e:  # a candidate config that does not build
                row[name] = f"{type(e).__name__}: {str(e)[:100]}"
                continue
            ref = got[name] if ref is None else ref
            fns[name] = fn
        for name, ms in rounds_ms(fns, reps=10).items():
            row[name] = {"us": round(ms * 1e3, 1), "tb_s": round(big.numel() * 2 / ms / 1e9, 2),
                         "rel": float((got[name].float() - ref.float()).norm() / ref.float().norm())}
        out["products"].append(row)
        print(row, flush=True)
    report(out, "bench_lora_products")


if __name__ == "__main__":
    main()
