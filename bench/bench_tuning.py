"""First-run kernel tuning at the published size (not a test): how long `kmoss tune_kernels`
takes from cold compile caches, and what it picks.

    PYTHONPATH=. python bench/bench_tuning.py [--budget-s 60] [--samples 2 4] [--full]

The problems are those of 1 MP samples (4096 image tokens, ~104 text tokens) packed 2 and 4
to a batch (8400 and 16800 token budgets) on the base flavor in bf16; a LoRA run times the
activations' gradients only (``--full``: every gradient). Prints one JSON object (and writes
``$OUT/bench_tuning.json`` on the device machine): the tuning time, the entries, and per op
and shape the winner, its speedup over the reference and its time.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from kohakumoss.kernels.problems import plan_problems
from kohakumoss.kernels.tuning import summary, tune_table
from kohakumoss.model import FLAVORS
from _report import report  # bench/_report.py (the script's folder is on sys.path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=60.0)
    ap.add_argument("--samples", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--full", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:  # cold compile caches: a first run
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache, "inductor"))
        os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(cache, "triton"))
        batches = [[(4096, 104)] * n for n in a.samples]
        problems = plan_problems(FLAVORS["base"], batches)
        t0 = time.perf_counter()
        section, result, _ = tune_table(os.path.join(cache, "kernels"), problems, "cuda",
                                        torch.bfloat16, budget_s=a.budget_s, params={}, inputs={},
                                        weights_grad=a.full)
        wall = time.perf_counter() - t0
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "budget_s": a.budget_s, "wall_s": wall,
           "tuning_s": result.seconds, "entries": len(result.entries),
           "untuned": list(result.untuned), "ops": summary(section)}
    report(res, "bench_tuning")


if __name__ == "__main__":
    main()
