"""GPU benchmark of the DiT at its real size with random weights (not a test).

    PYTHONPATH=. python bench/bench_dit.py [--flavor base] [--samples 2] [--grid 64] [--text 100]

Forward + backward (full finetune: every weight gets a gradient) of a packed batch of
``samples`` images of ``grid x grid`` latent cells (64 = 1024x1024 pixels) with ``text``
text tokens each, in bf16; tokens/s, achieved TFLOP/s (``kohakumoss.model.flops``) against
the measured bf16 matmul rate, peak memory; then the bf16 forward against a float32
forward (TF32 off) of the same bf16-exact weights on the same batch. The elementwise ops are
recomputed in backward (``apply_recompute``, as training does); without per-block
activation checkpointing first, then with it (``apply_block_checkpointing``, the memory
engine). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kohakumoss.memory import apply_block_checkpointing, apply_recompute
from kohakumoss.model import FLAVORS, build_layout, cast_model
from kohakumoss.model.build import random_transformer
from kohakumoss.model.flops import forward_flops, train_flops
from kohakumoss.checks.parity import rel_error
from _report import report  # bench/_report.py (the script's folder is on sys.path)


def timed(fn, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():  # CPU smoke run of the script itself
        out = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


def matmul_rate(device: str) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t = statistics.median(timed(lambda: a @ b, 3, 10))
    return 2 * 8192**3 / t


def train_step(model, inputs, layout):
    for p in model.parameters():
        p.grad = None
    model(*inputs, layout).float().square().mean().backward()


def run(model, inputs, layout, iters) -> dict:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        t_fwd = statistics.median(timed(lambda: model(*inputs, layout), 1, iters))
    times = timed(lambda: train_step(model, inputs, layout), 1, iters)
    return {"forward_s": t_fwd, "train_step_s": statistics.median(times), "train_step_all_s": times,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavor", default="base")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--grid", type=int, default=64)
    ap.add_argument("--text", type=int, default=100)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    dev = a.device
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    c = FLAVORS[a.flavor]
    layout = build_layout([(a.grid, a.grid)] * a.samples, [a.text] * a.samples).to(dev)
    g = torch.Generator(device=dev).manual_seed(1)
    img = torch.randn(layout.n_img, c.latent_channels, device=dev, generator=g)
    txt = torch.randn(layout.n_txt, c.text_dim, device=dev, generator=g)
    sigma = torch.rand(a.samples, device=dev, generator=g)
    res: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
                 "flavor": a.flavor, "params": c.num_params(),
                 "tokens": {"image": layout.n_img, "text": layout.n_txt, "joint": layout.n_joint},
                 "forward_flops": forward_flops(c, layout), "train_flops": train_flops(c, layout)}
    res["bf16_matmul_tflops"] = matmul_rate(dev) / 1e12 if dev == "cuda" else 1.0
    model = random_transformer(FLAVORS[a.flavor], dev, bf16_exact=True)
    with torch.no_grad():
        ref32 = model(img, txt, sigma, layout).double()
    cast_model(model, torch.bfloat16)
    apply_recompute(model)
    inputs = (img, txt, sigma)
    with torch.no_grad():
        out16 = model(img, txt, sigma, layout)
    res["bf16_vs_fp32_rel_error"] = rel_error(out16, ref32)
    del ref32
    for mode in ("plain", "block_checkpointing"):
        if mode == "block_checkpointing":
            apply_block_checkpointing(model)
        try:
            r = run(model, inputs, layout, a.iters)
        except torch.OutOfMemoryError as e:
            res[mode] = {"error": f"out of memory: {str(e).splitlines()[0]}"}
            torch.cuda.empty_cache()
            continue
        r["tokens_per_s"] = layout.n_joint / r["train_step_s"]
        r["achieved_tflops"] = res["train_flops"] / r["train_step_s"] / 1e12  # model FLOPs
        r["forward_tflops"] = res["forward_flops"] / r["forward_s"] / 1e12
        r["mfu"] = r["achieved_tflops"] / res["bf16_matmul_tflops"]
        res[mode] = r
        torch.cuda.empty_cache()
    res["date"] = time.strftime("%Y-%m-%d")
    report(res, "bench_dit")


if __name__ == "__main__":
    main()
