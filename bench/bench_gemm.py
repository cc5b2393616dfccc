"""Can a GEMM of our own beat cuBLAS at the DiT's block-linear shapes? (GPU, not a test.)

    PYTHONPATH=. python bench/bench_gemm.py [--tokens 8399 8403 16800] [--reps 8]

The fused linears of the kernels issue (SiTU in the up|gate projection's epilogue, the gated
residual in the output projection's and ``ffn_down``'s) need a GEMM whose epilogue is ours.
They pay only where that GEMM is about as fast as the vendor's: the epilogues save one pass
over a [tokens, width] tensor (~0.1 ms a block at 16.8k tokens), the products take 0.5-2.6 ms.
This script times, per shape (forward ``x W^T``; input gradient ``dy W``; the forward
accumulated onto an output, as the LoRA node's base product lands on the adapter's):

- cuBLAS (``torch.mm`` / ``addmm_``);
- a persistent Triton GEMM for sm90: TMA loads and stores (host descriptors), ``wgmma``
  through ``tl.dot``, fp32 accumulation, tiles walked in groups of 8 row tiles, in the tile
  configs that won a sweep on the H200 (128 x 256 and 256 x 128, K step 64, 3 stages; and
  128 x 256 in 2 stages, which leaves room for the accumulating epilogue's tile).

Each time is the median over events around ``--reps`` back-to-back calls (host work hidden),
descriptors built once. Prints one JSON object (``$OUT/bench_gemm.json`` on the device
machine). ``docs/performance.md`` has the figures.
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kohakumoss.model import FLAVORS
from _report import cuda_ms, report  # bench/_report.py (the script's folder is on sys.path)

# BM, BN, BK, stages, warps; 2 stages leave shared memory for the tile an accumulating
# epilogue loads (3 stages of 128 x 256 plus two output tiles exceed the H200's 227 KiB)
CONFIGS = ((128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 256, 64, 2, 8))


@triton.jit
def _gemm(a_desc, b_desc, c_desc, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
          PROGRAMS: tl.constexpr, B_KMAJOR: tl.constexpr, ACCUMULATE: tl.constexpr,
          STAGES: tl.constexpr):
    tiles_m, tiles_n, k_tiles = tl.cdiv(M, BM), tl.cdiv(N, BN), tl.cdiv(K, BK)
    per_group = 8 * tiles_n
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=True,
                         num_stages=STAGES):
        first_m = (tile // per_group) * 8
        rows = tl.minimum(tiles_m - first_m, 8)
        tm = first_m + (tile % per_group) % rows
        tn = (tile % per_group) // rows
        acc = tl.zeros((BM, BN), tl.float32)
        for kt in range(k_tiles):
            a = a_desc.load([tm * BM, kt * BK])
            if B_KMAJOR:
                acc = tl.dot(a, b_desc.load([tn * BN, kt * BK]).T, acc)
            else:
                acc = tl.dot(a, b_desc.load([kt * BK, tn * BN]), acc)
        if ACCUMULATE:
            acc += c_desc.load([tm * BM, tn * BN]).to(tl.float32)
        c_desc.store([tm * BM, tn * BN], acc.to(tl.bfloat16))


def triton_call(a, b, c, b_kmajor: bool, accumulate: bool, cfg):
    """A launch of the GEMM with its descriptors built once; sizes passed rounded up to 16
    (they only count tiles; Triton then compiles the variant it specializes for multiples
    of 16 whatever the token count)."""
    BM, BN, BK, stages, warps = cfg
    (M, K), N = a.shape, c.shape[1]
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    n_programs = min(sms, triton.cdiv(M, BM) * triton.cdiv(N, BN))
    descs = (TensorDescriptor.from_tensor(a, [BM, BK]),
             TensorDescriptor.from_tensor(b, [BN, BK] if b_kmajor else [BK, BN]),
             TensorDescriptor.from_tensor(c, [BM, BN]))
    sizes = [-(-v // 16) * 16 for v in (M, N, K)]
    return lambda: _gemm[(n_programs,)](*descs, *sizes, BM, BN, BK, n_programs, b_kmajor, accumulate,
                                        stages, num_warps=warps, num_stages=stages)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[8399, 8403, 16800])
    ap.add_argument("--reps", type=int, default=8)
    a = ap.parse_args()
    c = FLAVORS["base"]
    shapes = {"q/k/v/o": (c.dim, c.dim), "up|gate": (c.dim, 2 * c.ffn_dim), "down": (c.ffn_dim, c.dim)}
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for M in a.tokens:
        for name, (K, O) in shapes.items():
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
            w = torch.randn(O, K, device="cuda", dtype=torch.bfloat16, generator=g) / K ** 0.5
            dy = torch.randn(M, O, device="cuda", dtype=torch.bfloat16, generator=g)
            y, dx = torch.empty(M, O, device="cuda", dtype=torch.bfloat16), torch.empty_like(x)
            flops = 2 * M * K * O
            cases = {"forward": (lambda: torch.mm(x, w.t(), out=y), (x, w, y, True, False)),
                     "input gradient": (lambda: torch.mm(dy, w, out=dx), (dy, w, dx, False, False)),
                     "forward onto an output": (lambda: y.addmm_(x, w.t()), (x, w, y, True, True))}
            for case, (vendor, args) in cases.items():
                row = {"tokens": M, "linear": name, "K": K, "O": O, "case": case,
                       "cublas_ms": round(cuda_ms(vendor, a.reps), 4)}
                for cfg in CONFIGS:
                    label = f"triton_{cfg[0]}x{cfg[1]}x{cfg[3]}_ms"
                    try:
                        row[label] = round(cuda_ms(triton_call(*args, cfg), a.reps), 4)
                    except triton.runtime.errors.OutOfResources as e:
                        row[label] = f"does not fit: {str(e)[:60]}"
                best = min(v for k, v in row.items() if k.startswith("triton_") and isinstance(v, float))
                row["cublas_tflops"] = round(flops / row["cublas_ms"] / 1e9)
                row["triton_best_tflops"] = round(flops / best / 1e9)
                row["triton_vs_cublas"] = round(row["cublas_ms"] / best, 3)
                rows.append(row)
                print(row, flush=True)
    report({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"), "reps": a.reps,
            "rows": rows}, "bench_gemm")


if __name__ == "__main__":
    main()
