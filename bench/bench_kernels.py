"""Per-op benchmark of the kernel backends (not a test).

    PYTHONPATH=. python bench/bench_kernels.py [--flavor base] [--samples 2] [--grid 64]
        [--text 104] [--dtype bfloat16] [--ops situ,rms_norm,...] [--sweep] [--full]
        [--commit HASH]

For each op of the op table, at the shapes one joint block of the ``--flavor`` model (base:
D 3072, F 8192, 24 heads of 128) sees for a packed batch of ``samples`` images of
``grid x grid`` latent cells with ``text`` tokens each (2 x 64 x 64 + 104: 8400 tokens),
times the reference in eager mode, ``torch.compile`` of the reference and every registered
backend that can run here: the forward alone (no grad) and forward + backward (the input
gradients of an adapter run, or with ``--full`` of a full finetune). Median of ``--iters``
samples (each 10 calls back to back) after ``--warmup``, CUDA events; and the device's
kernel time per call (profiler; host launch gaps excluded).
Also the relative error of each backend against the reference, and the forward's effective
bandwidth (bytes of the inputs and the output over the kernel time). ``--sweep`` adds
Triton launch settings (programs per SM of the reducing backward kernels, elements per
warp, set alike for the elementwise and the row kernels). Prints one JSON object (and writes
``$OUT/bench_kernels.json``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from kohakumoss.kernels import KERNELS
from kohakumoss.kernels.problems import PROBLEMS
from kohakumoss.checks.parity import rel_error
from kohakumoss.model import FLAVORS
from kohakumoss.model import ops
from _report import report  # bench/_report.py (the script's folder is on sys.path)

DEFAULT_KNOBS = (4, 512, 1024)  # triton_common.PROGRAMS_PER_SM, (ROW_)ELEMENTS_PER_WARP


def timed(fn, warmup: int, iters: int, reps: int = 10) -> float:
    """Median seconds per call of ``fn()``, each sample timing ``reps`` calls back to back
    (so the host's launch work overlaps the device's, as in a model's forward)."""
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    out = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                fn()
            b.record()
            torch.cuda.synchronize()
            out.append(a.elapsed_time(b) / 1e3 / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            out.append((time.perf_counter() - t0) / reps)
    return statistics.median(out)


def device_time(fn, reps: int = 10) -> float | None:
    """Seconds per call the device spends in kernels (profiler), launch gaps excluded."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in prof.key_averages())
    return total_us / 1e6 / reps


def problem_dims(args) -> dict[str, int]:
    """Every op at the joint sequence's size (``rms_norm`` and ``residual`` run on the text
    tokens in the model, but their kernels are measured at the same size as the rest)."""
    c = FLAVORS[args.flavor]
    img, txt = args.grid * args.grid, args.text
    return {"N": args.samples * (img + txt), "D": c.dim, "B": args.samples, "F": c.ffn_dim,
            "H": c.heads, "Dh": c.head_dim, "L": img + txt}


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def bench_op(op: str, dims: dict, dtype: torch.dtype, device: torch.device, args) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    inputs = PROBLEMS[op].make(dims, dtype, device, g, args.full)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    with torch.no_grad():
        ref_out = ops.REFERENCE[op](*inputs)
    grad = torch.randn_like(ref_out)

    variants = {"eager": (ops.REFERENCE[op], None)}
    try:
        variants["compile"] = (KERNELS.backend(op, "compile").fn, None)
    except Exception:  # no registered compile backend for this op: compile the reference here
        variants["compile"] = (torch.compile(ops.REFERENCE[op]), None)
    for b in KERNELS.eligible(op, device, dtype, allow=KERNELS.names(op)):  # opt-in ones too
        if b.name != "compile":
            variants[b.name] = (b.fn, None)
            if b.name == "triton" and args.sweep:  # launch settings: programs/SM, elements/warp
                for pps, epw in ((2, 512), (8, 512), (4, 256), (4, 1024), (4, 2048)):
                    variants[f"triton[pps={pps},epw={epw}]"] = (b.fn, (pps, epw, epw))

    res: dict = {"dims": dims, "backends": {}}
    common = None
    for name, (fn, knobs) in variants.items():
        entry: dict = {}
        if name.startswith("triton"):
            from kohakumoss.kernels import triton_common as common
            (common.PROGRAMS_PER_SM, common.ELEMENTS_PER_WARP,
             common.ROW_ELEMENTS_PER_WARP) = knobs or DEFAULT_KNOBS
            entry["knobs"] = {"programs_per_sm": common.PROGRAMS_PER_SM,
                              "elements_per_warp": common.ELEMENTS_PER_WARP,
                              "row_elements_per_warp": common.ROW_ELEMENTS_PER_WARP}
        try:
            with torch.no_grad():
                out = fn(*inputs)
                entry["rel_error"] = rel_error(out, ref_out)
                entry["fwd_ms"] = 1e3 * timed(lambda: fn(*inputs), args.warmup, args.iters)
                kernel = device_time(lambda: fn(*inputs))
                if kernel is not None:
                    entry["fwd_kernel_ms"] = 1e3 * kernel
                    entry["fwd_kernel_GBps"] = nbytes(*inputs, out) / kernel / 1e9

            def step():
                for t in leaves:
                    t.grad = None
                fn(*inputs).backward(grad)

            entry["fwd_bwd_ms"] = 1e3 * timed(step, args.warmup, args.iters)
            kernel = device_time(step)
            if kernel is not None:
                entry["fwd_bwd_kernel_ms"] = 1e3 * kernel
        except Exception as e:  # a backend that cannot run this shape: say so, go on
            entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        res["backends"][name] = entry
    if common is not None:
        (common.PROGRAMS_PER_SM, common.ELEMENTS_PER_WARP,
         common.ROW_ELEMENTS_PER_WARP) = DEFAULT_KNOBS
    base = res["backends"]["eager"]
    comp = res["backends"].get("compile", {})
    for name, entry in res["backends"].items():
        for key in ("fwd_ms", "fwd_bwd_ms", "fwd_kernel_ms", "fwd_bwd_kernel_ms"):
            if key in entry and key in base:
                entry[f"{key.removesuffix('_ms')}_x_eager"] = round(base[key] / entry[key], 2)
            if key in entry and key in comp:
                entry[f"{key.removesuffix('_ms')}_x_compile"] = round(comp[key] / entry[key], 2)
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--flavor", default="base")
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--grid", type=int, default=64)
    p.add_argument("--text", type=int, default=104)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--ops", default=",".join(PROBLEMS))
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--commit", default="")
    p.add_argument("--sweep", action="store_true", help="also time Triton launch settings")
    p.add_argument("--full", action="store_true",
                   help="weights and modulation take gradients too (a full finetune; default: "
                        "an adapter run, where only the activations do)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
    env = {"device": name,
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "commit": args.commit,
           "dtype": args.dtype, "gradients": "all" if args.full else "activations (adapter run)",
           "batch": f"{args.samples} x ({args.grid}x{args.grid} + {args.text})"}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    results = {op: bench_op(op, problem_dims(args), dtype, device, args)
               for op in args.ops.split(",")}
    report({"env": env, "ops": results}, "bench_kernels")


if __name__ == "__main__":
    main()
