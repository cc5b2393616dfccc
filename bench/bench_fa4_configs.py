"""FlashAttention-4's sm90 launch configs at the model's attention shapes, backward and
forward. (GPU, not a test; needs the ``fa4`` extra.)

    PYTHONPATH=. python bench/bench_fa4_configs.py [--segments 4200 4200 4200 4194] [--passes bwd fwd]

The ``fa4`` backend (``kernels/attention/fa4.py``) calls ``_flash_attn_bwd`` with the config
the package selects: for head dim 128 on sm90, C++ FA3's 80 x 128 tiles, benchmarked by its
authors on an H100. A profile of the 16,800-token step puts that backward at 157 ms
(~580 TFLOP/s). This times the selected config against variants of it (``BwdConfig``
fields replaced; a variant the package's own validation refuses is listed as refused), on
packed segments of 24 heads of 128 in bf16: the median over CUDA events
(``_report.cuda_ms``), TFLOP/s at 2.5x the forward's 4 L^2 H Dh a segment, and dq, dk, dv's
largest relative difference from the selected config's.

The forward (``--passes fwd``; a sampling step's attention is the forward alone, 17% of it):
for head dim 128 the package picks 128 x 128 tiles with the P V product from registers and
the warpgroups' overlap, where C++ FA3 picks 128 x 176 for non-causal attention. The
variants are the interface's own arguments (``tile_mn``, ``mma_pv_is_rs``,
``intra_wg_overlap``); one that wins goes to ``kernels/fa4_attention.FWD_LAUNCH``. Try
``--segments 4202 4106`` (a CFG sampling step). Prints one JSON object
(``$OUT/bench_fa4_configs.json`` on the device machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch
from flash_attn.cute import interface as fa4

from _report import cuda_ms, report  # bench/_report.py (the script's folder is on sys.path)

# BwdConfig fields replaced in the selected config (for head dim 128 it has tile_m 80,
# tile_n 128, two Q / dO / PdS stages, SdP_swapAB and dQ_swapAB, AtomLayoutNdKV 2)
BWD_VARIANTS = {
    "selected": {},
    "tile_m 64": {"tile_m": 64, "dQ_swapAB": False},
    "tile_m 64, dQ atoms 2": {"tile_m": 64, "dQ_swapAB": False, "AtomLayoutMdQ": 2},
    "tile_m 96": {"tile_m": 96, "dQ_swapAB": False},
    "tile_m 128, tile_n 64": {"tile_m": 128, "tile_n": 64, "dQ_swapAB": False, "AtomLayoutMSdP": 2},
    "PdS 1 stage": {"num_stages_PdS": 1},
    "dO 1 stage": {"num_stages_dO": 1},
    "V in registers": {"V_in_regs": True},
    "no SdP swap": {"SdP_swapAB": False, "AtomLayoutMSdP": 2},
}
# the forward's interface arguments (any tile request also turns on RS and the overlap)
FWD_VARIANTS = {
    "selected": {},
    "128 x 176": {"tile_mn": (128, 176)},
    "128 x 192": {"tile_mn": (128, 192)},
    "128 x 160": {"tile_mn": (128, 160)},
    "128 x 144": {"tile_mn": (128, 144)},
    "128 x 112": {"tile_mn": (128, 112)},
    "128 x 96": {"tile_mn": (128, 96)},
    "192 x 128, no RS": {"tile_mn": (192, 128), "mma_pv_is_rs": False},
    "no RS": {"mma_pv_is_rs": False},
    "no overlap": {"intra_wg_overlap": False},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--segments", type=int, nargs="+", default=[4200, 4200, 4200, 4194])
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--passes", nargs="+", choices=["bwd", "fwd"], default=["bwd", "fwd"])
    a = ap.parse_args()
    dev, g = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    N, H, Dh = sum(a.segments), a.heads, a.head_dim
    q, k, v, do = (torch.randn(N, H, Dh, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(4))
    cu = torch.tensor([0, *torch.tensor(a.segments).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    longest, scale = max(a.segments), 1.0 / math.sqrt(Dh)
    o, lse, *_ = fa4._flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                     max_seqlen_k=longest, softmax_scale=scale, return_lse=True)

    def bwd(config=None):
        return fa4._flash_attn_bwd(q, k, v, o, do, lse, scale, False, 0.0, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                   max_seqlen_q=longest, max_seqlen_k=longest, config=config)[:3]

    def fwd(**launch):
        return fa4._flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                   max_seqlen_k=longest, softmax_scale=scale, return_lse=True, **launch)[:1]

    def timed(run, want, flops) -> dict:
        try:
            got = run()
            ms = cuda_ms(run, reps=5, iters=7)
        except Exception as e:  # refused by the package's validation, or does not build
            return {"refused": f"{type(e).__name__}: {str(e)[:160]}"}
        return dict(ms=round(ms, 3), tflops=round(flops / ms / 1e9),
                    max_rel=max(float((x.float() - w.float()).norm() / w.float().norm()) for x, w in zip(got, want)))

    out = {"device": torch.cuda.get_device_name(), "segments": a.segments, "heads": H, "head_dim": Dh,
           "variants": []}
    forward_flops = sum(4 * n * n * H * Dh for n in a.segments)
    if "bwd" in a.passes:
        chosen = []  # the package's own choice, caught as it is made
        select = fa4.select_bwd_config
        fa4.select_bwd_config = lambda inputs: chosen.append(select(inputs)) or chosen[-1]
        try:
            want = bwd()
        finally:
            fa4.select_bwd_config = select
        out["selected"] = {f.name: getattr(chosen[0], f.name) for f in dataclasses.fields(chosen[0])
                           if f.name != "registers"}
        for name, fields in BWD_VARIANTS.items():
            row = {"pass": "bwd", "variant": name, "fields": fields}
            try:
                config = dataclasses.replace(chosen[0], **fields)
            except Exception as e:
                row["refused"] = f"{type(e).__name__}: {str(e)[:160]}"
            else:
                row.update(timed(lambda: bwd(config), want, 2.5 * forward_flops))
            out["variants"].append(row)
            print(row, flush=True)
    if "fwd" in a.passes:
        want = fwd()
        for name, launch in FWD_VARIANTS.items():
            row = {"pass": "fwd", "variant": name, "fields": {k: list(v) if isinstance(v, tuple) else v
                                                                for k, v in launch.items()}}
            row.update(timed(lambda: fwd(**launch), want, forward_flops))
            out["variants"].append(row)
            print(row, flush=True)
    report(out, "bench_fa4_configs")


if __name__ == "__main__":
    main()
