"""GPU benchmark: what one joint block keeps for backward at the published width, measured
against the memory estimator's count (not a test).

    PYTHONPATH=. python bench/bench_kept.py [--params bench/train.yaml] [-S key=value ...]
                                            [--variant 'profile=speed' --variant 'profile=balanced']
                                            [--kernels reference triton+compile] [--samples 4]

The run is a params file as ``kmoss train`` reads it (``bench/train.yaml``: rank-32 LoRA on
attention + MLP, bf16), with ``-S section.key=value`` overrides and each ``--variant`` (a
set of overrides; default: the ``speed`` and ``balanced`` profiles) measured in turn, built
by the library (``engine_plan`` with the variant's profile resolved by ``resolve_profile``,
then ``build_training``). For each op table (``--kernels``: ``reference``, or backends joined
by ``+`` in order of preference) and variant: the published transformer with 2 and with 4
joint blocks (random weights), one forward in the run's autocast over 1 MP samples; the
allocator's growth over the forward, its difference between the two depths halved, is what
one joint block keeps. ``estimate_per_block_mib`` is the same difference of
``kohakumoss.training.estimate.estimate(...).activations``. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import time
from pathlib import Path

import torch

from kohakumoss.config import Params
from kohakumoss.model import FLAVORS, build_layout
from kohakumoss.model.build import random_transformer
from kohakumoss.training.autoprofile import resolve_profile
from kohakumoss.training.build import build_training
from kohakumoss.training.engines import engine_plan
from kohakumoss.training.estimate import estimate
from bench_train import PARAMS, bench_params, kernel_choices  # bench/ (the script's folder is on sys.path)
from _report import report

MiB = 2**20
VARIANTS = ("profile=speed", "profile=balanced")


def kept_bytes(p: Params, depth: int, kernels: list[str], samples: int) -> tuple[int, int]:
    """(allocator growth over one forward, the estimator's activations) at ``depth``, the
    run ``p`` built as ``build_training`` builds it."""
    device = torch.device("cuda")
    cfg = dataclasses.replace(FLAVORS["base"], depth=depth, negative_skip_layers=())
    batch = [(4096, 104)] * samples
    memory = resolve_profile(p, batch, device, config=cfg).engines
    plan = dataclasses.replace(engine_plan(p, device, memory=memory), kernels=kernel_choices(kernels))
    model = random_transformer(cfg, "cuda")
    training = build_training(p, plan, model, device)
    layout = build_layout([(64, 64)] * samples, [104] * samples).to("cuda")
    z = torch.randn(layout.n_img, cfg.latent_channels, device="cuda")
    text = torch.randn(layout.n_txt, cfg.text_dim, device="cuda", dtype=plan.precision.compute)
    sigma = torch.rand(samples, device="cuda")
    for _ in range(2):  # the second forward: kernels built, caches warm
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with plan.precision.autocast(device):
            out = training.model(z, text, sigma, layout)
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before
        out.float().square().mean().backward()
        training.optimizer.zero_grad(set_to_none=True)
    del training, model, out
    torch.cuda.empty_cache()
    return kept, estimate(p, batch, memory, config=cfg).activations


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=Path, default=PARAMS, help="the run's params file")
    ap.add_argument("-S", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="section.key=value over the params file (repeatable)")
    ap.add_argument("--variant", action="append", default=[], metavar="'KEY=VALUE ...'",
                    help="a set of overrides measured in turn, on top of -S (repeatable; "
                         f"default: {' and '.join(VARIANTS)})")
    ap.add_argument("--kernels", nargs="*", default=["reference", "triton+compile"],
                    help="op tables: reference, or backends joined by + in order of preference")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--name", default="", help="the report's file name under $OUT")
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "params": str(a.params), "overrides": a.overrides,
           "samples": a.samples, "rows": []}
    for table in a.kernels:
        names = [] if table == "reference" else table.split("+")
        for variant in a.variant or list(VARIANTS):
            p = bench_params(a.params, a.overrides + shlex.split(variant))
            (k2, e2), (k4, e4) = (kept_bytes(p, d, names, a.samples) for d in (2, 4))
            res["rows"].append({"kernels": table, "variant": variant, "profile": p.profile,
                                "measured_per_block_mib": (k4 - k2) / 2 / MiB,
                                "estimate_per_block_mib": (e4 - e2) / 2 / MiB})
            print(res["rows"][-1], flush=True)
    report(res, a.name or "bench_kept")


if __name__ == "__main__":
    main()
