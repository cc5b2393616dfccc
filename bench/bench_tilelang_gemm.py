"""The TileLang GEMM (``ops.linear``'s ``tilelang`` backend) against cuBLAS, in the forms a
training step calls it (GPU, not a test).

    PYTHONPATH=. python bench/bench_tilelang_gemm.py [--tokens 16800 8403] [--reps 20]

A step calls the block linears' products in four forms: the forward ``x W^T`` and the input
gradient ``dy W``, each plain (a plain linear) or accumulated onto an output (the LoRA node:
the base product lands on the adapter's output, ``addmm_`` with beta 1 on cuBLAS). Per
shape and form this times cuBLAS and TileLang with CUDA events, as the median of ``--reps``
single calls and as the mean of ``--reps`` back-to-back calls; and, per backend, the host's
cost of one call of the op as a step makes it (``ops.linear``'s entry: checks, custom op,
launcher), on a 64-row problem where the device's time is negligible. One JSON object
(``$OUT/bench_tilelang_gemm.json`` on the device machine); ``docs/performance.md`` has the
figures.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from kohakumoss.experimental.tilelang import gemm as G
from kohakumoss.model import ops
from _report import cuda_ms, report  # bench/_report.py (the script's folder is on sys.path)

# (K, O): q/k/v/o, q|k|v as one, up|gate, down
SHAPES = ((3072, 3072), (3072, 9216), (3072, 16384), (8192, 3072))
FORMS = ("forward", "forward+acc", "input_grad", "input_grad+acc")


def _events(fn, reps: int) -> tuple[float, float]:
    """(median ms of single calls, mean ms of back-to-back calls)."""
    return cuda_ms(fn, 1, reps), cuda_ms(fn, reps, 1)


def _calls(M: int, K: int, O: int, form: str):
    dev, dt = "cuda", torch.bfloat16
    w = torch.randn(O, K, device=dev, dtype=dt) * 0.02
    grad = form.startswith("input_grad")
    a = torch.randn(M, O if grad else K, device=dev, dtype=dt)
    out = torch.randn(M, K if grad else O, device=dev, dtype=dt)
    b_op = w if grad else w.t()  # cuBLAS: a @ b_op
    acc = form.endswith("+acc")
    if acc:
        cublas = lambda: out.addmm_(a, b_op)  # noqa: E731
    else:
        cublas = lambda: torch.mm(a, b_op, out=out)  # noqa: E731
    tl = lambda: G.gemm(a, w, out, b_kmajor=not grad, accumulate=acc)  # noqa: E731
    return cublas, tl


def _host_cost(backend: str, reps: int = 400) -> float:
    """µs of host time per ``ops.linear`` call with an accumulator (a LoRA node's base
    product) on a 64-row problem."""
    x = torch.randn(64, 3072, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3072, 3072, device="cuda", dtype=torch.bfloat16)
    acc = torch.zeros(64, 3072, device="cuda", dtype=torch.bfloat16)
    fn = ops.linear if backend == "cublas" else G.linear
    for _ in range(10):
        fn(x, w, acc)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn(x, w, acc)
    host = (time.perf_counter() - t) / reps
    torch.cuda.synchronize()
    return host * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[16800, 8403])
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    cfg = G.tiles(torch.cuda.get_device_capability())
    builds = [(K, O, "bfloat16", kmajor, acc, cfg) for K, O in SHAPES for kmajor in (True, False)
              for acc in (False, True)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as ex:  # TileLang builds in parallel; none inside the timings
        list(ex.map(lambda job: G._build(*job), builds))
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tiles": cfg,
           "build_s": round(time.perf_counter() - t0, 1), "rows": []}
    print(f"built {len(builds)} kernels in {res['build_s']} s", flush=True)
    for M in a.tokens:
        for K, O in SHAPES:
            for form in FORMS:
                cublas, tl = _calls(M, K, O, form)
                cb, tb = _events(cublas, a.reps), _events(tl, a.reps)
                row = {"tokens": M, "K": K, "O": O, "form": form,
                       "cublas_ms": round(cb[0], 4), "tilelang_ms": round(tb[0], 4),
                       "x_cublas": round(cb[0] / tb[0], 3),
                       "cublas_b2b_ms": round(cb[1], 4), "tilelang_b2b_ms": round(tb[1], 4),
                       "x_cublas_b2b": round(cb[1] / tb[1], 3)}
                res["rows"].append(row)
                print(row, flush=True)
    res["host_us_per_call"] = {b: round(_host_cost(b), 1) for b in ("cublas", "tilelang")}
    report(res, "bench_tilelang_gemm")


if __name__ == "__main__":
    main()
