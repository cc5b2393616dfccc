"""TileLang attention forward against torch's (cuDNN) at the published size (not a test).

    PYTHONPATH=. python bench/bench_tilelang_attention.py [--configs 128,128,2,256 ...]

For a training batch (4 x 4200 tokens) and a sampling step's packed CFG pair (4202 + 4106
tokens), 24 heads of 128, bf16: the reference (``ops.varlen_attention``: torch SDPA per
segment, cuDNN on the H200) and each TileLang forward config (query tile, key tile, pipeline
stages, threads), the relative error of the output against the reference, the median time of
``--iters`` calls (CUDA events) and the rate (4 L^2 Dh H FLOPs per segment). Also the
backward (forward + backward of the autograd op) of the backend as built, against the
reference's. Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch

from kohakumoss.model import ops
from bench_dit import timed  # the script's folder is on sys.path


def _time(fn, iters: int) -> float:
    """Median milliseconds of ``iters`` calls after 3 warm-up calls (CUDA events)."""
    return statistics.median(timed(fn, 3, iters)) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", nargs="*", default=["128,128,2,256", "128,64,2,256", "128,128,1,256",
                                                    "64,64,2,128", "128,64,3,256"])
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    import tilelang

    from kohakumoss.experimental.tilelang import kernels as K
    from kohakumoss.experimental.tilelang import ops as tilelang_ops

    H, Dh, dtype = 24, 128, torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, lengths in (("train", [4200] * 4), ("sample", [4202, 4106])):
        N = sum(lengths)
        q, k, v = (torch.randn(N, H, Dh, device="cuda", dtype=dtype, generator=g) for _ in range(3))
        flops = sum(4 * n * n * Dh * H for n in lengths)
        with torch.no_grad():
            ref = ops.varlen_attention(q, k, v, lengths)
            t = _time(lambda: ops.varlen_attention(q, k, v, lengths), args.iters)
        print(json.dumps({"shape": name, "backend": "reference (SDPA)", "ms": round(t, 4),
                          "tflops": round(flops / t / 1e9, 1)}))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        for cfg in args.configs:
            BM, BN, stages, threads = (int(x) for x in cfg.split(","))
            try:
                kern = tilelang.compile(K.attention_forward(H, Dh, "bfloat16", BM, BN, stages, threads))
                o = torch.empty_like(q)
                lse = torch.empty(N, H, device="cuda", dtype=torch.float32)
                tiles = math.ceil(max(lengths) / BM)
                call = lambda: kern(q, k, v, cu, o, lse, tiles)  # noqa: E731
                call()
                err = float((o.float() - ref.float()).norm() / ref.float().norm())
                t = _time(call, args.iters)
                print(json.dumps({"shape": name, "backend": "tilelang", "config": cfg, "ms": round(t, 4),
                                  "tflops": round(flops / t / 1e9, 1), "rel_error": err}))
            except Exception as e:  # a config that does not build: say so, go on
                print(json.dumps({"shape": name, "backend": "tilelang", "config": cfg,
                                  "failed": f"{type(e).__name__}: {str(e)[-300:]}"}))
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        do = torch.randn_like(q)
        for label, fn in (("reference (SDPA)", ops.varlen_attention), ("tilelang", tilelang_ops.varlen_attention)):
            t = _time(lambda: torch.autograd.grad(fn(qg, kg, vg, lengths), (qg, kg, vg), do), args.iters)
            print(json.dumps({"shape": name, "backend": label, "pass": "forward+backward", "ms": round(t, 4),
                              "tflops": round(3.5 * flops / t / 1e9, 1)}))


if __name__ == "__main__":
    main()
