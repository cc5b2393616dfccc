"""GPU benchmark of training steps at the published size, random weights (not a test).

    PYTHONPATH=. python bench/bench_train.py [--budgets 8192 16384] [--steps 6] [--full]
                                             [--kernels triton compile]
                                             [--checkpointing block] [--profile]

LoRA: rank 32 (alpha 32) on attention + MLP of every joint block (252 linears), bf16 base,
fp32 adapter, AdamW. Batches come from a latent cache and a text cache (``TensorStore``
shards on local disk) filled with synthetic entries of the real shapes: 1 MP samples of
4096 image tokens x 128 channels and ~100-token texts x 4096; each step packs as many
samples as the token budget holds. Reported: samples/s, step time, peak memory, and MFU =
model FLOPs of the step (forward, input gradients everywhere, weight gradients only for
the adapter; ``kohakumoss.model.flops.train_flops(full=False)``) over the measured bf16
matmul rate. ``--full``: one full-finetune step (fp32 master weights, bf16 autocast,
AdamW) and its peak memory. Both models get the engines a training run applies
(``apply_engines``: precision policy, op table, recomputation). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import tempfile
import time

import torch

from kohakumoss.cache.store import TensorStore
from kohakumoss.config import AdapterConfig, OptimConfig
from kohakumoss.diffusion.objective import flow_loss, noised
from kohakumoss.kernels import KERNELS
from kohakumoss.model import FLAVORS, MOSSImageTransformer, build_layout
from kohakumoss.model.build import random_transformer
from kohakumoss.model.engines import Handle
from kohakumoss.model.flops import train_flops
from kohakumoss.quant.plan import decode
from kohakumoss.precision import precision_policy
from kohakumoss.memory.allocator import tight_allocator
from kohakumoss.memory.profiles import MemoryEngines
from kohakumoss.memory.quantized import keep_fp8_transposes
from kohakumoss.memory.stepping import FusedStep, StreamedStates
from kohakumoss.training.engines import EnginePlan, apply_engines
from kohakumoss.training.optim import build_optimizer
from _report import CardLog, report  # bench/_report.py (the script's folder is on sys.path)


KERNEL_CHOICES: dict[str, str | list[str]] = {}  # --kernels: {op: backends in order}
ENGINES = {}  # --checkpointing, --checkpoint-blocks, --no-recompute: the EnginePlan's memory
COMPILE_BLOCKS: list[bool] = [False]  # --compile-blocks
NO_OVERLAP: list[bool] = [False]  # --no-overlap
CHAIN: list[bool] = [True]  # --chain: the model's chain_adds
CAP: list[float] = [0.0]  # --cap: the allocator's limit in GiB (0: none)


def compile_blocks(model: MOSSImageTransformer) -> None:
    """Each repeated block's forward (adapters included) through ``torch.compile`` with
    dynamic token counts: one graph serves every block of a list."""
    from kohakumoss.memory.checkpointing import repeated_blocks

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 128)
    torch._dynamo.config.accumulated_cache_size_limit = max(
        torch._dynamo.config.accumulated_cache_size_limit, 1024)
    blocks = [block for _, block in repeated_blocks(model)]
    for block in blocks:
        block.compile(dynamic=True)
    model.engines.register(Handle("compiled blocks", blocks=tuple(blocks)))  # they run whole


def kernel_choices(names: list[str]) -> dict[str, list[str]]:
    """``--kernels triton compile``: per op, those of the named backends it has, in order
    (the reference stays the fallback)."""
    from kohakumoss.model.ops import REFERENCE
    from kohakumoss.training.engines import QUANT_BACKENDS  # --quant-backends chooses those

    return {op: [n for n in names if n in KERNELS.names(op)] for op in REFERENCE
            if any(n in KERNELS.names(op) for n in names) and op not in QUANT_BACKENDS
            and op not in PER_SHAPE and op not in APART}


PER_SHAPE = ("linear",)  # ops whose backend is chosen per shape (``--tune``), never statically
APART = ("narrow_mm",)  # ops an option of their own chooses (``--narrow``), not ``--kernels``
TUNED: dict[str, list[str]] = {}  # --tune: "op/dtype/key" -> backends, fastest first


def tune_per_shape(batches: list, allow: list[str], weights_grad: bool = False) -> dict:
    """The tuner's choice for ``PER_SHAPE`` ops at these batches' shapes (bf16, on the
    device), as ``EnginePlan.tuned`` takes it, timing the backends ``allow`` names (opt-in
    ones too; none: the default set); each entry's times printed."""
    from kohakumoss.kernels.problems import plan_problems
    from kohakumoss.kernels.tuning import tune

    problems = {op: shapes for op, shapes in plan_problems(FLAVORS["base"], batches).items()
                if op in PER_SHAPE}
    result = tune(problems, "cuda", torch.bfloat16, budget_s=120, weights_grad=weights_grad,
                  allow=allow or None)
    for key, entry in result.entries.items():
        print(json.dumps({"tuned": key, "order": entry["order"], "ms": entry["ms"]}), flush=True)
    return {key: entry["order"] for key, entry in result.entries.items()}


def host_peak_gib() -> float:
    """The process's peak resident host memory (GiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def held_gib() -> float:
    """What the device holds beyond this process's allocator: CUDA context, cuBLAS
    workspaces, the allocator's reserve (GiB, from the driver's free memory)."""
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


# --bases: (precision.base, precision.fp8_compute)
_BASES = {"keep": ("keep", "off"), "int8": ("int8", "off"), "fp8": ("fp8", "off"),
          "fp8-compute": ("fp8", "on"), "fp8-full": ("fp8", "full"), "fp8-full-fast": ("fp8", "fast"),
          "fp8-full-rows": ("fp8", "full"), "fp8-full-kept": ("fp8", "full")}
# fp8-full-fast: precision.fp8_compute fast (full with fast accumulation in the input-gradient
# GEMMs); fp8-full-rows: full with the LoRA's narrow products made inside the row quantization
# (fp8_lora_linears' scaled_mm_rows, chosen by name); fp8-full-kept: full with the codes'
# transposes kept between steps (memory.fp8_transposes, which profile speed sets)
_BASE_BACKENDS = {"fp8-full-rows": {"fp8_lora_linears": ["scaled_mm_rows", "scaled_mm"]}}


def random_base(full: bool, base: str = "keep") -> MOSSImageTransformer:
    """The base flavor with random weights and a training run's engines (bf16 compute);
    ``base``: keep, int8, fp8 (weight-only), fp8-compute, fp8-full or fp8-full-fast
    (``precision.base`` and ``precision.fp8_compute`` on / full / fast), or a variant of full."""
    model = random_transformer(FLAVORS["base"], "cuda")
    policy = precision_policy("bf16", full=full, **decode(*_BASES[base]).policy_args())
    applied = apply_engines(model, EnginePlan(torch.device("cuda"), policy,
                                              kernels=KERNEL_CHOICES, tuned=TUNED, **ENGINES))
    if base == "fp8-full-kept":
        keep_fp8_transposes(model)
    torch.cuda.empty_cache()
    model.chain_adds = CHAIN[0]
    print(json.dumps({"op_table": applied.kernels, "base": applied.quantized or base,
                      "chain_adds": model.chain_adds}), flush=True)
    return model


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * 10 / (time.perf_counter() - t0)


def fill_caches(root: str, n: int, text_len: int) -> tuple[TensorStore, TensorStore]:
    lat, txt = TensorStore(f"{root}/lat", "bf16"), TensorStore(f"{root}/txt", "bf16")
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        lat.add(f"{i:032x}", torch.randn(4096, 128, generator=g))
        txt.add(f"{i:032x}", torch.randn(text_len + i % 7, 4096, generator=g))
    lat.flush()
    txt.flush()
    return TensorStore(f"{root}/lat", "bf16"), TensorStore(f"{root}/txt", "bf16")


def step_inputs(lat, txt, keys, step, device="cuda"):
    """One step's batch on the device as ``kmoss train`` makes it (``training.ahead``): read
    from the caches, through page-locked memory, queued behind the device's work."""
    x0 = torch.cat([lat.get(k) for k in keys]).pin_memory().to(device, non_blocking=True)
    texts = [txt.get(k) for k in keys]
    layout = build_layout([(64, 64)] * len(keys), [len(t) for t in texts]).to(device)
    text = torch.cat(texts).pin_memory().to(device, non_blocking=True)
    g = torch.Generator(device=device).manual_seed(step)
    sigma = torch.rand(len(keys), device=device, generator=g)
    eps = torch.randn(x0.shape, device=device, generator=g)
    z, target = noised(x0, eps, sigma[layout.seg_img])
    return z, target, text, sigma, layout


def step_fn(model, opt, batch, update=None, upcoming=None, stepper=None):
    """One step on ``batch`` (``step_inputs``); ``upcoming()`` makes the next step's batch
    while the device runs this backward, as the trainer does; ``stepper``: the step in
    backward or the streamed states (``memory.stepping``). Returns the layout and it."""

    z, target, text, sigma, layout = batch
    with torch.autocast("cuda", dtype=torch.bfloat16):
        pred = model(z, text, sigma, layout)
    loss = flow_loss(pred, target, layout.seg_img, torch.ones(len(sigma), device=z.device), layout.n_img)
    if isinstance(stepper, FusedStep):
        stepper.arm()
    loss.backward()
    following = upcoming() if upcoming is not None else None
    if update is not None:  # memory.optimizer host: the gradients gathered on the host
        update.finish_backward()
        update.step(opt)  # overlapped: beside the next step's forward
    elif isinstance(stepper, FusedStep):
        stepper.finish()
    else:
        if stepper is not None:
            stepper.step()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return layout, following


def predicted_peak(batch: list[tuple[int, int]], full: bool, base: str = "keep") -> float:
    """The memory estimator's peak (GiB) for this bench's run: the base flavor, rank-32 LoRA
    (or a full finetune), bf16, AdamW, the --checkpointing engines, the base held as ``base``
    (fp8-full-kept: with the codes' transposes kept, as the run holds them)."""
    from kohakumoss.params import parse_params
    from kohakumoss.training.estimate import GiB, estimate

    precision = {"base": _BASES[base][0], "fp8_compute": _BASES[base][1]}
    p = parse_params({"data": {"datasets": [{"source": "kohya", "path": "unused"}]},
                      "adapter": {"algo": "full"} if full else {"algo": "lora", "dim": 32, "alpha": 32.0},
                      "train": {"dtype": "bf16"}, "precision": precision}, "bench")
    engines = ENGINES.get("memory", MemoryEngines())
    if base == "fp8-full-kept":
        engines = dataclasses.replace(engines, fp8_transposes=True)
    return estimate(p, batch, engines, config=FLAVORS["base"]).peak / GiB


def stream_gaps(trace: str) -> dict:
    """From a Chrome trace of one step: each CUDA stream's busy time, and the compute
    stream's (the busiest one's) idle time split into what waited on a copy running on
    another stream (the link) and what waited on nothing on the device (the host)."""
    import gzip

    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    spans: dict[int, list[tuple[float, float, str]]] = {}
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "stream" in e.get("args", {}):
            spans.setdefault(e["args"]["stream"], []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    if not spans:
        return {}
    busy = {s: sum(b - a for a, b, _ in v) for s, v in spans.items()}
    main = max(busy, key=busy.get)
    copies = sorted((a, b) for s, v in spans.items() if s != main for a, b, _ in v)
    mine = sorted(spans[main])
    on_copy = on_host = 0.0
    gaps = []
    for (a0, b0, n0), (a1, _, n1) in zip(mine, mine[1:]):
        if a1 <= b0:
            continue
        overlap = sum(max(0.0, min(b, a1) - max(a, b0)) for a, b in copies if a < a1 and b > b0)
        overlap = min(overlap, a1 - b0)
        on_copy += overlap
        on_host += a1 - b0 - overlap
        gaps.append((a1 - b0, overlap, n0[:50], n1[:50]))
    gaps.sort(key=lambda g: -g[0])
    return {"compute_stream": main, "busy_ms": {str(s): round(t / 1e3, 1) for s, t in busy.items()},
            "compute_idle_during_copies_ms": round(on_copy / 1e3, 1),
            "compute_idle_otherwise_ms": round(on_host / 1e3, 1),
            "compute_gaps": [{"us": round(g), "copying_us": round(c), "after": a, "before": b}
                             for g, c, a, b in gaps[:12]]}


def profile_step(run_step, rows: int = 45) -> dict:
    """One step under ``torch.profiler``: the CUDA kernels by self time (top ``rows``), the
    share of the kernel time each family takes (matmul, attention, triton, eager
    elementwise, other), the torch ops by self CPU time, and how long the host took to
    enqueue the step against the GPU's busy time (a host-bound step idles the GPU)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        run_step()
        enqueue = time.perf_counter() - t0
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    streams = {}
    if os.environ.get("OUT"):  # the trace comes back with the report
        trace = os.path.join(os.environ["OUT"], f"trace-{time.strftime('%H%M%S')}.json.gz")
        prof.export_chrome_trace(trace)
        streams = stream_gaps(trace)
    events = prof.key_averages()
    kernels = [(e.key, e.self_device_time_total, e.count) for e in events
               if e.self_device_time_total > 0]
    kernels.sort(key=lambda k: -k[1])
    total = sum(t for _, t, _ in kernels) or 1.0
    cpu = sorted(((e.key, e.self_cpu_time_total, e.count) for e in events if e.self_cpu_time_total > 0),
                 key=lambda k: -k[1])

    def family(name: str) -> str:
        n = name.lower()
        if any(s in n for s in ("gemm", "sm90_xmma", "cutlass", "nvjet", "matmul", "splitk")):
            return "matmul"
        if any(s in n for s in ("flash", "fmha", "attention", "sdpa", "cudnn")):
            return "attention"
        if any(s in n for s in ("elementwise", "vectorized", "reduce", "copy", "cat", "index",
                                "fill", "where", "memset", "memcpy", "sort")):
            return "eager elementwise"
        if n.startswith("_") or "triton" in n:
            return "triton"
        return "other"

    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    gaps, end, before = [], spans[0][0] if spans else 0, ""
    for start, stop, name in spans:  # GPU idle between kernels: what the host did not feed
        if start > end:
            gaps.append((start - end, before[:60], name[:60]))
        if stop > end:
            end, before = stop, name
    gaps.sort(key=lambda g: -g[0])
    families: dict[str, float] = {}
    for name, t, _ in kernels:
        families[family(name)] = families.get(family(name), 0.0) + t
    return {"wall_ms": round(wall * 1e3, 1), "enqueue_ms": round(enqueue * 1e3, 1), "streams": streams,
            "kernel_ms": round(total / 1e3, 2), "kernel_launches": sum(c for _, _, c in kernels),
            "gpu_idle_ms": round(sum(g for g, _, _ in gaps) / 1e3, 2),
            "gaps": [{"ms": round(g / 1e3, 2), "after": a, "before": b} for g, a, b in gaps[:12]],
            "families": {k: round(v / total, 3) for k, v in sorted(families.items(), key=lambda kv: -kv[1])},
            "top": [{"kernel": name[:100], "ms": round(t / 1e3, 2), "calls": c, "share": round(t / total, 3)}
                    for name, t, c in kernels[:rows]],
            "cpu_top": [{"op": name[:80], "ms": round(t / 1e3, 2), "calls": c} for name, t, c in cpu[:rows]]}


def bench_lora(budget: int, steps: int, text_len: int, rate: float, root: str,
               profiled: bool = False, base: str = "keep") -> dict:
    from kohakumoss.adapters import apply_adapters

    per = max(1, budget // (4096 + text_len + 3))
    lat, txt = fill_caches(root, per * (steps + 2), text_len)
    gc.collect()  # the previous run's model (LyCORIS's wrappers hold cycles)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    model = random_base(full=False, base=base)
    weights = (torch.cuda.memory_allocated() - before) / 2**30  # the model as held, no adapter
    adapters = apply_adapters(model, AdapterConfig(algo="lora", dim=32, alpha=32.0), seed=0)
    ring = None
    memory = ENGINES.get("memory", MemoryEngines())
    if memory.stream_slots:
        from kohakumoss.memory.streaming import apply_weight_streaming

        ring = apply_weight_streaming(model, torch.device("cuda"), memory.stream_slots,
                                      resident=memory.resident_blocks)
        torch.cuda.empty_cache()
    if CAP[0]:  # the allocator capped from here on (the model was built on the card uncapped)
        torch.cuda.set_per_process_memory_fraction(CAP[0] * 2**30 / torch.cuda.mem_get_info()[1])
    if COMPILE_BLOCKS[0]:
        compile_blocks(model)
    named = list(adapters.named_trainable())
    update = None
    if memory.optimizer == "host":
        from kohakumoss.adapters.inject import lora_name
        from kohakumoss.memory.host_update import HostUpdate
        from kohakumoss.memory.overlap import OverlappedUpdate

        update = HostUpdate(named, torch.device("cuda")) if NO_OVERLAP[0] else \
            OverlappedUpdate(named, torch.device("cuda"), model, renamed=lora_name)
        opt = build_optimizer(update.named_masters, OptimConfig(lr=1e-4))
        update.attach(opt)
    else:
        opt = build_optimizer(named, OptimConfig(lr=1e-4))
    stepper = None
    if memory.optimizer in ("fused", "streamed"):
        stepper = FusedStep(named, opt) if memory.optimizer == "fused" else \
            StreamedStates(named, opt, torch.device("cuda"))
    keys = [f"{i:032x}" for i in range(per * (steps + 2))]
    times, segments = [], []  # each timed step's time and its samples' joint lengths
    torch.cuda.reset_peak_memory_stats()
    held = 0.0
    card = CardLog(torch.cuda.current_device())
    try:
        batch = step_inputs(lat, txt, keys[:per], 0)
        with card:  # the card's clock and power over the steps
            for s in range(steps + 2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                upcoming = (lambda s=s: step_inputs(lat, txt, keys[(s + 1) * per:(s + 2) * per], s + 1)) \
                    if s + 1 < steps + 2 else None
                layout, batch = step_fn(model, opt, batch, update, upcoming, stepper)
                torch.cuda.synchronize()
                held = max(held, held_gib())
                if s >= 2:
                    times.append(time.perf_counter() - t0)
                    segments.append(list(layout.joint_len))
            if update is not None:
                update.wait()
    except torch.OutOfMemoryError as e:
        out = {"budget": budget, "samples_per_step": per, "cap_gib": CAP[0], "error": "out of memory",
               "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
               "estimate_gib": predicted_peak([(4096, 104)] * per, full=False, base=base),
               "detail": str(e).splitlines()[0][:200]}
        del model, opt, adapters, ring, update, stepper
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
        return out
    t = statistics.median(times)
    flops = train_flops(FLAVORS["base"], layout, full=False)
    est = predicted_peak([(n, 104) for n in layout.img_len], full=False, base=base)
    peak = torch.cuda.max_memory_allocated() / 2**30
    reserved = torch.cuda.max_memory_reserved() / 2**30
    if profiled:  # the step as the loop runs it: its batch made before, the next one inside
        batch = step_inputs(lat, txt, keys[:per], 0)
        prof = profile_step(lambda: step_fn(model, opt, batch, update,
                                            lambda: step_inputs(lat, txt, keys[per:2 * per], 1),
                                            stepper))
    else:
        prof = None
    streamed = {"stream_slots": memory.stream_slots, "loads_per_step": ring.loads / (steps + 2 + bool(prof)),
                "host_weights_gib": ring.host_bytes() / 2**30} if ring else {}
    offloaded = getattr(model, "offloader", None)
    if offloaded is not None:
        streamed["offloaded_gib_per_step"] = offloaded.bytes / 2**30
    del model, opt, adapters, ring, update, stepper
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()
    return {"budget": budget, "base": base, "weights_gib": weights,
            "samples_per_step": per, "joint_tokens": layout.n_joint, "cap_gib": CAP[0],
            "step_s": t, "step_times_s": [round(x, 4) for x in times],
            "step_segments": segments, "card": card.summary(), "samples_per_s": per / t,
            "peak_gib": peak, "estimate_gib": est,
            "reserved_gib": reserved, "device_used_gib": held, "host_peak_gib": host_peak_gib(),
            **streamed,
            "model_tflops_per_step": flops / 1e12, "mfu": flops / t / rate, "trainable_params":
            sum(p.numel() for _, p in named), **({"profile": prof} if prof else {})}


def bench_full(text_len: int, root: str, steps: int = 3) -> dict:
    """A full finetune, one 1 MP sample per step (fp32 masters, bf16 autocast, AdamW), with
    the --memory-profile / knobs' engines: streamed blocks and the host update when set
    (the model is built on the card, then its blocks move to the host; --cap applies from
    then on)."""
    lat, txt = fill_caches(root + "/full", steps + 2, text_len)
    model = random_base(full=True)
    named = list(model.named_parameters())
    memory = ENGINES.get("memory", MemoryEngines())
    update = None
    if memory.optimizer == "host":
        from kohakumoss.memory.host_update import HostUpdate

        update = HostUpdate(named, torch.device("cuda"))  # streamed blocks: not overlapped
        named = update.named_masters
    if memory.stream_slots:
        from kohakumoss.memory.streaming import apply_weight_streaming

        ring = apply_weight_streaming(model, torch.device("cuda"), memory.stream_slots, trainable=True,
                                      dtype=torch.bfloat16)
        if update is not None:
            update.before_push.append(ring.invalidate)
    torch.cuda.empty_cache()
    if CAP[0]:
        torch.cuda.set_per_process_memory_fraction(CAP[0] * 2**30 / torch.cuda.mem_get_info()[1])
    opt = build_optimizer(named, OptimConfig(lr=1e-5))
    if update is not None:
        update.attach(opt)
    torch.cuda.reset_peak_memory_stats()
    times, held = [], 0.0
    try:
        batch = step_inputs(lat, txt, [f"{0:032x}"], 0)
        for s in range(steps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            upcoming = (lambda s=s: step_inputs(lat, txt, [f"{s + 1:032x}"], s + 1)) if s < steps else None
            _, batch = step_fn(model, opt, batch, update, upcoming)
            torch.cuda.synchronize()
            held = max(held, held_gib())
            if s >= 1:
                times.append(time.perf_counter() - t0)
        out = {"samples": 1, "step_s": statistics.median(times), "samples_per_s": 1 / statistics.median(times),
               "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
               "reserved_gib": torch.cuda.max_memory_reserved() / 2**30, "device_used_gib": held}
    except torch.OutOfMemoryError as e:
        out = {"error": str(e).splitlines()[0][:200], "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    out.update(cap_gib=CAP[0], memory=memory.describe(), host_peak_gib=host_peak_gib(),
               estimate_gib=predicted_peak([(4096, 104)], full=True))
    del model, opt, update
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", type=int, nargs="*", default=[8192, 16384],
                    help="LoRA token budgets to measure (none: only --full)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--text", type=int, default=100)
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--kernels", nargs="*", default=[],
                    help="backends to prefer for every op that has them, in order (e.g. triton "
                         "compile); none: the references")
    ap.add_argument("--checkpointing", default="none",
                    help="activation checkpointing mode: none, block, sub-block, selective, partial")
    ap.add_argument("--checkpoint-blocks", type=int, default=0, help="partial: blocks per list")
    ap.add_argument("--no-recompute", action="store_true",
                    help="keep the elementwise ops' intermediates instead of recomputing them")
    ap.add_argument("--compile-blocks", action="store_true",
                    help="torch.compile each block with its adapters (dynamic token counts)")
    ap.add_argument("--offload", action="store_true",
                    help="with --checkpointing block / sub-block: the kept inputs (and attention "
                         "outputs) in host memory")
    ap.add_argument("--host-optimizer", action="store_true",
                    help="the optimizer on the host (gradients offloaded, AdamW on the CPU)")
    ap.add_argument("--optimizer", choices=["fused", "streamed"], default=None,
                    help="the adapter's update placed as memory.optimizer fused (the step in "
                         "backward) or streamed (states from the host), over any engines")
    ap.add_argument("--stream-slots", type=int, default=0,
                    help="stream the frozen base's block weights through this many device slots")
    ap.add_argument("--memory-profile", default="",
                    help="a profile's engines (speed, balanced, low, minimal) instead of the knobs")
    ap.add_argument("--cap", type=float, nargs="*", default=[0.0],
                    help="cap the allocator at this many GiB (set_per_process_memory_fraction) "
                         "for the steps; several: each budget is measured under each cap")
    ap.add_argument("--bases", nargs="*", default=["keep"],
                    help="the frozen base as held: keep (bf16), int8, fp8, fp8-compute, fp8-full, "
                         "fp8-full-fast (precision.fp8_compute fast: fast accumulation in its "
                         "input gradients too), "
                         "fp8-full-rows (the narrow products inside the row quantization), "
                         "fp8-full-kept (the codes' transposes kept between steps); each "
                         "budget is measured with each, in one run")
    ap.add_argument("--narrow", nargs="*", default=["cublas"],
                    choices=["cublas", *KERNELS.names("narrow_mm")[1:]],  # cublas: the reference
                    help="how the LoRA nodes' narrow products (x A^T, dy B) are made (ops.narrow_mm's "
                         "backends, kernels/narrow.py; cublas: the reference); "
                         "several: each base and budget is measured with each")
    ap.add_argument("--chain", nargs="*", choices=["on", "off"], default=["on"],
                    help="the joint blocks chained (each half's closing add made by the next "
                         "norm, the model's default: on) or block by block (off); several: each "
                         "base and budget is measured with each")
    ap.add_argument("--quant-backends", nargs="*", default=[],
                    help="a quantized base's quant_linear backends, in order (default: the "
                         "engines' own, dequant_mm from 1024 rows, else the fused triton kernel)")
    ap.add_argument("--resident-blocks", type=int, default=0,
                    help="streaming: the first blocks' weights stay on the device (auto fills this)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="with the host optimizer: the update between steps, not beside the next "
                         "forward (kmoss train overlaps an adapter's)")
    ap.add_argument("--fixed-segments", action="store_true",
                    help="leave the allocator as it is (by default a streamed or offloaded run "
                         "takes expandable segments, as kmoss train does)")
    ap.add_argument("--linear-backend", default="tilelang", help="the backend --linear-shapes forces")
    ap.add_argument("--linear-shapes", nargs="*", default=[], metavar="KxO",
                    help="the block linears of these shapes on --linear-backend (untuned)")
    ap.add_argument("--tune", action="store_true",
                    help="the per-shape ops (the block linears' GEMM) as the tuner picks them")
    ap.add_argument("--tune-backends", nargs="*", default=[],
                    help="with --tune: the backends it times (opt-in ones: tilelang)")
    ap.add_argument("--name", default="", help="the report's file name under $OUT")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one step per budget: kernels by CUDA time, shares by family")
    a = ap.parse_args()
    KERNEL_CHOICES.update(kernel_choices(a.kernels))
    if a.tune:
        TUNED.update(tune_per_shape([[(4096, a.text)] * (b // 4200) for b in a.budgets], a.tune_backends))
    for shape in a.linear_shapes:  # "KxO": that backend there, whatever the tuner would say
        from kohakumoss.kernels.problems import PROBLEMS

        K, O = (int(v) for v in shape.split("x"))
        for b in a.budgets:
            key = PROBLEMS["linear"].key({"N": b, "K": K, "O": O})
            TUNED[f"linear/bfloat16/{key}"] = [a.linear_backend, "reference"]
    if a.quant_backends:
        KERNEL_CHOICES["quant_linear"] = a.quant_backends
    ENGINES["memory"] = MemoryEngines(a.checkpointing, a.checkpoint_blocks, not a.no_recompute,
                                      a.stream_slots, optimizer="host" if a.host_optimizer else "device",
                                      offload=a.offload)
    if a.memory_profile:
        from kohakumoss.memory.profiles import PROFILE_ENGINES

        ENGINES["memory"] = PROFILE_ENGINES[a.memory_profile]
    if a.resident_blocks:
        ENGINES["memory"] = dataclasses.replace(ENGINES["memory"], resident_blocks=a.resident_blocks)
    if a.optimizer:
        ENGINES["memory"] = dataclasses.replace(ENGINES["memory"], optimizer=a.optimizer)
    expandable = False if a.fixed_segments else tight_allocator(ENGINES["memory"], torch.device("cuda"))
    caps = a.cap or [0.0]
    COMPILE_BLOCKS[0] = a.compile_blocks
    NO_OVERLAP[0] = a.no_overlap
    rate = matmul_rate()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "kernels": a.kernels,
           "checkpointing": a.checkpointing, "checkpoint_blocks": a.checkpoint_blocks,
           "recompute": not a.no_recompute, "memory": ENGINES["memory"].describe(),
           "memory_profile": a.memory_profile, "cap_gib": caps, "quant_backends": a.quant_backends,
           "compile_blocks": a.compile_blocks, "expandable_segments": expandable,
           "overlapped_update": not a.no_overlap,
           "date": time.strftime("%Y-%m-%d"), "bf16_matmul_tflops": rate / 1e12, "lora": []}
    with tempfile.TemporaryDirectory() as root:
        for cap in caps:
            CAP[0] = cap
            for i, base in enumerate(a.bases):  # a base may come twice (A B A B: the card's drift)
                for op in ("fp8_linear", "fp8_lora_linears"):
                    KERNEL_CHOICES.pop(op, None)
                KERNEL_CHOICES.update(_BASE_BACKENDS.get(base, {}))
                for how, chain in [(h, c) for h in a.narrow for c in a.chain or ["on"]]:
                    CHAIN[0] = chain == "on"  # each way asked; cublas: the reference
                    KERNEL_CHOICES.pop("narrow_mm", None)
                    if how != "cublas":
                        KERNEL_CHOICES["narrow_mm"] = [how]
                    for b in a.budgets:
                        res["lora"].append({**bench_lora(b, a.steps, a.text, rate,
                                                         f"{root}/{cap:g}-{b}-{base}-{i}-{how}-{chain}",
                                                         a.profile, base),
                                            "narrow": how, "chain": chain})
                        print(json.dumps(res["lora"][-1]), flush=True)
        if a.full:
            res["full"] = bench_full(a.text, root, a.steps)
            print(json.dumps(res["full"]), flush=True)
    report(res, a.name or "bench_train")


if __name__ == "__main__":
    main()
