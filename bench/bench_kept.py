"""GPU benchmark: what one joint block keeps for backward at the published width, measured
against the memory estimator's count (not a test).

    PYTHONPATH=. python bench/bench_kept.py [--kernels reference triton+compile triton]
                                            [--profiles speed balanced] [--samples 4]

For each op table and memory profile: the published transformer with 2 and with 4 joint
blocks (random bf16 weights, rank-32 LoRA on attention + MLP), one bf16 forward over 1 MP
samples; the allocator's growth over the forward, its difference between the two depths
halved, is what one joint block keeps. ``estimate_per_block_mib`` is the same difference
of ``kohakumoss.training.estimate.estimate(...).activations``. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from kohakumoss.adapters import apply_adapters
from kohakumoss.config import AdapterConfig
from kohakumoss.memory.profiles import PROFILE_ENGINES
from kohakumoss.model import FLAVORS, build_layout
from kohakumoss.model.build import random_transformer
from kohakumoss.params import parse_params
from kohakumoss.precision import precision_policy
from kohakumoss.training.engines import EnginePlan, apply_engines
from kohakumoss.training.estimate import estimate
from bench_train import kernel_choices  # bench/ (the script's folder is on sys.path)
from _report import report

MiB = 2**20


def kept_bytes(depth: int, kernels: list[str], profile: str, samples: int) -> tuple[int, int]:
    """(allocator growth over one forward, the estimator's activations) at ``depth``."""
    cfg = dataclasses.replace(FLAVORS["base"], depth=depth, negative_skip_layers=())
    model = random_transformer(cfg, "cuda")
    apply_adapters(model, AdapterConfig(algo="lora", dim=32, alpha=32.0), seed=0)
    apply_engines(model, EnginePlan(torch.device("cuda"), precision_policy("bf16", full=False),
                                    kernels=kernel_choices(kernels), memory=PROFILE_ENGINES[profile]))
    layout = build_layout([(64, 64)] * samples, [104] * samples).to("cuda")
    z = torch.randn(layout.n_img, cfg.latent_channels, device="cuda")
    text = torch.randn(layout.n_txt, cfg.text_dim, device="cuda", dtype=torch.bfloat16)
    sigma = torch.rand(samples, device="cuda")
    for _ in range(2):  # the second forward: kernels built, caches warm
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(z, text, sigma, layout)
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before
        out.float().square().mean().backward()
        model.zero_grad(set_to_none=True)
    del model, out
    torch.cuda.empty_cache()
    p = parse_params({"data": {"datasets": [{"source": "kohya", "path": "unused"}]},
                      "adapter": {"algo": "lora", "dim": 32, "alpha": 32.0},
                      "train": {"dtype": "bf16"}}, "bench")
    return kept, estimate(p, [(4096, 104)] * samples, PROFILE_ENGINES[profile], config=cfg).activations


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", nargs="*", default=["reference", "triton+compile"],
                    help="op tables: reference, or backends joined by + in order of preference")
    ap.add_argument("--profiles", nargs="*", default=["speed", "balanced"])
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--name", default="", help="the report's file name under $OUT")
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "samples": a.samples, "rows": []}
    for table in a.kernels:
        names = [] if table == "reference" else table.split("+")
        for profile in a.profiles:
            (k2, e2), (k4, e4) = (kept_bytes(d, names, profile, a.samples) for d in (2, 4))
            res["rows"].append({"kernels": table, "profile": profile,
                                "measured_per_block_mib": (k4 - k2) / 2 / MiB,
                                "estimate_per_block_mib": (e4 - e2) / 2 / MiB})
            print(res["rows"][-1], flush=True)
    report(res, a.name or "bench_kept")


if __name__ == "__main__":
    main()
