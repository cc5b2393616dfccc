"""GPU benchmark of sampling at the published size, random weights (not a test).

    PYTHONPATH=. python bench/bench_sample.py [--params bench/train.yaml] [-S key=value ...]
                                              [--steps 50] [--batches 1 4] [--kernels triton]
                                              [--compile-blocks] [--chain on off]

The 5.08B DiT in bf16 (random weights), 1024x1024 images (4096 image tokens), a 112-token
prompt embedding and the ~10-token empty-caption negative, 50 Euler steps at shift 5 with
CFG 3 (positive and negative packed into one forward; the negative skips block 22), then
the FLUX.2 VAE decode (random weights, bf16). Seconds per image and peak memory per batch
size. The frozen model is held as the params say, as ``kmoss sample`` holds it
(``sampling_policy``: ``-S precision.base=int8|fp8``, ``-S precision.fp8_compute=on`` for
fp8 GEMMs; ``--params`` a params file, ``bench/train.yaml`` by default). ``--kernels``: the op table prefers those backends (as ``bench_train.py``);
``--compile-blocks``: each repeated block's forward goes through ``torch.compile`` (one
graph for all blocks of a list; the compile time is reported apart); ``--chain on off``: the
blocks chained (each half's closing gated add made by the kernel of the norm that opens the
next, ``JointBlock.chained``, the default) and block by block, in turn. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kohakumoss.config import Params
from kohakumoss.diffusion.sampler import Request, sample
from kohakumoss.model import FLAVORS, MOSSImageTransformer
from kohakumoss.model.build import random_transformer
from kohakumoss.model.engines import Handle
from kohakumoss.quant import quant_plan
from _report import CardLog, report  # bench/_report.py (the script's folder is on sys.path)


def random_dit(p: Params, kernels: list[str], compile_blocks: bool, tune: bool = False) -> MOSSImageTransformer:
    """The base flavor with random weights, held in bf16 as ``kmoss sample`` holds it for the
    params ``p`` (``sampling_policy``: the base quantized as ``precision.*`` says)."""
    from bench_train import kernel_choices, tune_per_shape

    from kohakumoss.memory.checkpointing import repeated_blocks
    from kohakumoss.memory.profiles import MemoryEngines
    from kohakumoss.precision.policy import sampling_policy
    from kohakumoss.training.engines import EnginePlan, apply_engines

    model = random_transformer(FLAVORS["base"], "cuda")
    no_recompute = MemoryEngines(checkpointing="none", recompute=False)  # sampling keeps no graph
    quant = quant_plan(p.precision)
    policy = sampling_policy(torch.bfloat16, p.precision, quant.base, quant.compute)
    tuned = tune_per_shape([[(4096, 112), (4096, 10)]], ["tilelang"]) if tune else {}
    applied = apply_engines(model, EnginePlan(torch.device("cuda"), policy, kernels=kernel_choices(kernels),
                                              memory=no_recompute, tuned=tuned))
    print(json.dumps({"op_table": applied.kernels}), flush=True)
    if compile_blocks:  # a compiled block runs whole (its call is what is compiled)
        blocks = [block for _, block in repeated_blocks(model)]
        for block in blocks:
            block.compile()
        model.engines.register(Handle("compiled blocks", blocks=tuple(blocks)))
    return model.eval()


def main() -> None:
    from bench_train import PARAMS, bench_params

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=Path, default=PARAMS, help="a params file (its precision section)")
    ap.add_argument("-S", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="section.key=value over the params file (repeatable): precision.base, "
                         "precision.fp8_compute")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--kernels", nargs="*", default=[])
    ap.add_argument("--compile-blocks", action="store_true")
    ap.add_argument("--no-vae", action="store_true")
    ap.add_argument("--cuda-graph", nargs="*", choices=["off", "on"], default=["off"],
                    help="replay the forward as a CUDA graph (on), eager (off), or both in turn")
    ap.add_argument("--chain", nargs="*", choices=["off", "on"], default=["on"],
                    help="the blocks chained (each half's closing add made by the next norm, "
                         "the model's default: on), block by block (off), or both in turn")
    ap.add_argument("--profile", action="store_true", help="profile 2 steps of batch 1 (bench_train's)")
    ap.add_argument("--tune", action="store_true",
                    help="the per-shape ops (the block linears' GEMM) as the tuner picks them")
    ap.add_argument("--name", default="", help="the report's file name under $OUT")
    a = ap.parse_args()
    p = bench_params(a.params, a.overrides)
    model = random_dit(p, a.kernels, a.compile_blocks, a.tune)
    g = torch.Generator().manual_seed(0)
    pos = torch.randn(112, 4096, generator=g)
    neg = torch.randn(10, 4096, generator=g)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "steps": a.steps, "size": "1024x1024", "runs": [],
           "kernels": a.kernels, "overrides": a.overrides, "tuned": a.tune, "compile_blocks": a.compile_blocks}
    t0 = time.perf_counter()
    sample(model, [Request(pos, neg, (64, 64), 0)], 2, 3.0, 5.0, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    res["warmup_seconds"] = time.perf_counter() - t0
    if a.profile:
        from bench_train import profile_step

        res["profile"] = profile_step(lambda: sample(model, [Request(pos, neg, (64, 64), 0)], 2, 3.0, 5.0,
                                                     device="cuda", dtype=torch.bfloat16))
    for chain, graph in [(c, g) for c in a.chain or ["on"] for g in a.cuda_graph or ["on"]]:
        model.chain_adds = chain == "on"
        for b in a.batches:
            reqs = [Request(pos, neg, (64, 64), i) for i in range(b)]
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
            with CardLog(torch.cuda.current_device()) as card:  # the card's clock and power
                t0 = time.perf_counter()
                lat = sample(model, reqs, a.steps, 3.0, 5.0, device="cuda", dtype=torch.bfloat16,
                             cuda_graph=graph == "on")
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
            res["runs"].append({"batch": b, "cuda_graph": graph, "chain": chain, "seconds": dt,
                                "seconds_per_image": dt / b,
                                "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                                "card": card.summary()})
            print(json.dumps(res["runs"][-1]), flush=True)
    if a.no_vae:
        report(res, a.name or "bench_sample")
        return
    from diffusers import AutoencoderKLFlux2

    from kohakumoss.encoders.vae import VAE

    torch.manual_seed(0)
    vae = VAE(AutoencoderKLFlux2().to("cuda", torch.bfloat16), torch.bfloat16, torch.device("cuda"),
              "flux2-vae")
    grid = lat[0].T.reshape(1, 128, 64, 64).cuda()
    vae.decode(grid)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    vae.decode(grid)
    torch.cuda.synchronize()
    res["vae_decode_seconds"] = time.perf_counter() - t0
    report(res, a.name or "bench_sample")


if __name__ == "__main__":
    main()
