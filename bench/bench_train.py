"""Training steps at the published size with random weights, through the library's own
run: the params a ``kmoss train`` run reads (``bench/train.yaml``, ``-S section.key=value``
overrides, as ``dvc exp run -S``), its memory profile resolved by ``resolve_profile``, its
model side built by ``build_components``' ``build_training`` (engines, trainable set,
optimizer, schedule, EMA, stepper) and its steps made by ``Trainer.step``. Only the data is
the bench's: synthetic latent and text caches (``TensorStore`` shards on local disk) of the
real shapes, read through page-locked memory one micro-batch ahead as the trainer reads its
own (not a test)::

    PYTHONPATH=. python bench/bench_train.py [--params bench/train.yaml] [-S key=value ...]
        [--variant "key=value key=value" ...] [--budgets 8400 16800] [--steps 6]
        [--kernels fa4 triton compile] [--tune] [--chain on off] [--cap 24]
        [--compile-blocks] [--profile] [--name NAME]

Examples: ``-S precision.base=fp8 -S precision.fp8_compute=fast`` (fp8 compute),
``-S profile=manual -S memory.checkpointing=block`` (per-block checkpointing),
``-S profile=minimal --cap 24`` (a card of 24 GiB), ``-S adapter.algo=full`` (a full
finetune). Each ``--variant`` is measured in turn in the same process, on top of the ``-S``
overrides (``--variant "" --variant "precision.base=fp8 precision.fp8_compute=fast"
--variant ""``: bf16, fp8, bf16: the card's drift shows). Each budget packs as many
``--grid``-squared-token samples (64: 1 MP) with ~``--text``-token captions as it holds.
Reported per (variant, budget, chain, cap): samples/s, step times, peak memory beside the
estimator's, and MFU = the step's model FLOPs (``kohakumoss.model.flops.train_flops``) over
the bf16 matmul rate measured in the same process. Prints JSON lines and one report
(``_report.report``). ``--flavor tiny --grid 2 -S train.device=cpu``: the same path on the
CPU (``tests/test_bench_train.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import shlex
import statistics
import tempfile
import time
import types
from pathlib import Path

import torch
import yaml

from kohakumoss.cache.store import TensorStore
from kohakumoss.config import Params
from kohakumoss.device import resolve_device
from kohakumoss.diffusion.objective import noised
from kohakumoss.kernels import KERNELS
from kohakumoss.memory.allocator import tight_allocator
from kohakumoss.model import FLAVORS, build_layout
from kohakumoss.model.build import random_transformer
from kohakumoss.model.engines import Handle
from kohakumoss.model.flops import train_flops
from kohakumoss.model.ops import REFERENCE
from kohakumoss.params import parse_params
from kohakumoss.training.ahead import Ahead
from kohakumoss.training.autoprofile import resolve_profile
from kohakumoss.training.build import Components, RunPaths, build_training
from kohakumoss.training.engines import QUANT_BACKENDS, engine_plan
from kohakumoss.training.inputs import StepInputs
from kohakumoss.training.trainer import Trainer
from _report import CardLog, report  # bench/_report.py (the script's folder is on sys.path)

PARAMS = Path(__file__).with_name("train.yaml")
PER_SHAPE = ("linear",)  # ops whose backend is chosen per shape (``--tune``), never statically


# -- the run's params ----------------------------------------------------------------------
def override(raw: dict, assignment: str) -> None:
    """``section.key=value`` (the value read as YAML) set in the raw params ``raw``."""
    key, sep, value = assignment.partition("=")
    if not sep or not key:
        raise SystemExit(f"-S {assignment!r}: expected section.key=value")
    *path, last = key.split(".")
    node = raw
    for part in path:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise SystemExit(f"-S {assignment!r}: {part} is not a section")
    node[last] = yaml.safe_load(value)


def bench_params(path: Path, overrides: list[str]) -> Params:
    """``path`` with ``overrides`` applied, parsed and checked as ``kmoss train`` parses its
    params (the checks that read weight files aside: the bench makes random weights)."""
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    for assignment in overrides:
        override(raw, assignment)
    return parse_params(raw, str(path))


def kernel_choices(names: list[str]) -> dict[str, list[str]]:
    """``--kernels``: ``triton compile`` (per op, those of the named backends it has, in
    order) and ``op=backend,backend`` (that op's choice); the reference stays the fallback."""
    chosen = {op: [n for n in names if "=" not in n and n in KERNELS.names(op)]
              for op in REFERENCE if op not in QUANT_BACKENDS and op not in PER_SHAPE}
    chosen = {op: b for op, b in chosen.items() if b}
    for name in names:
        op, sep, backends = name.partition("=")
        if sep:
            chosen[op] = backends.split(",")
    return chosen


def tune_per_shape(batches: list, allow: list[str], weights_grad: bool = False,
                   config=FLAVORS["base"], device="cuda") -> dict:
    """The tuner's choice for ``PER_SHAPE`` ops at these batches' shapes (bf16), as
    ``EnginePlan.tuned`` takes it, timing the backends ``allow`` names (opt-in ones too;
    none: the default set); each entry's times printed."""
    from kohakumoss.kernels.problems import plan_problems
    from kohakumoss.kernels.tuning import tune

    problems = {op: shapes for op, shapes in plan_problems(config, batches).items() if op in PER_SHAPE}
    result = tune(problems, device, torch.bfloat16, budget_s=120, weights_grad=weights_grad,
                  allow=allow or None)
    for key, entry in result.entries.items():
        print(json.dumps({"tuned": key, "order": entry["order"], "ms": entry["ms"]}), flush=True)
    return {key: entry["order"] for key, entry in result.entries.items()}


# -- the synthetic data a Trainer reads ------------------------------------------------------
@dataclasses.dataclass
class Shapes:
    grid: int  # latent grid side (64: a 1 MP sample, 4096 tokens)
    text: int  # caption tokens (each sample's varies by up to 6 more)
    per: int  # samples per step
    channels: int
    text_dim: int

    @property
    def image_tokens(self) -> int:
        return self.grid * self.grid


class SyntheticData:
    """Latent and text caches of random entries of the real shapes, and what ``Trainer``
    reads of a plan, its caches and its batches: the plan's hash, the caches' identities, a
    step's loss tokens. ``ahead()`` is the trainer's ``Ahead`` over them."""

    content_hash = text_id = vae_id = "synthetic"

    def __init__(self, root: Path, shapes: Shapes, steps: int, device: torch.device):
        self.shapes, self.device = shapes, device
        self.keys = [f"{i:032x}" for i in range(shapes.per * steps)]
        lat, txt = TensorStore(root / "lat", "bf16"), TensorStore(root / "txt", "bf16")
        g = torch.Generator().manual_seed(0)
        for i, k in enumerate(self.keys):
            lat.add(k, torch.randn(shapes.image_tokens, shapes.channels, generator=g))
            txt.add(k, torch.randn(shapes.text + i % 7, shapes.text_dim, generator=g))
        lat.flush()
        txt.flush()
        self.lat, self.txt = TensorStore(root / "lat", "bf16"), TensorStore(root / "txt", "bf16")

    def contents(self) -> list:
        return []

    def step_image_tokens(self, step: int) -> int:
        return self.shapes.per * self.shapes.image_tokens

    def flush(self) -> None:
        pass

    def _moved(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def make(self, keys: list[str], step: int):
        """One step's micro-batch as ``Trainer.make_inputs`` makes one: read from the caches,
        through page-locked memory, queued behind the device's work."""
        x0 = self._moved(torch.cat([self.lat.get(k) for k in keys]).float())
        texts = [self.txt.get(k) for k in keys]
        layout = build_layout([(self.shapes.grid,) * 2] * len(keys), [len(t) for t in texts]).to(self.device)
        text = self._moved(torch.cat(texts))
        g = torch.Generator(device=self.device).manual_seed(step)
        sigma = torch.rand(len(keys), device=self.device, generator=g)
        eps = torch.randn(x0.shape, device=self.device, generator=g)
        z, target = noised(x0, eps, sigma[layout.seg_img])
        batch = types.SimpleNamespace(micro=0, rank=0, captions=keys, global_index=step)
        return batch, StepInputs(z, target, text, sigma, layout, torch.ones_like(sigma), layout.n_img)

    def ahead(self, first: int = 0) -> Ahead:
        per = self.shapes.per
        loader = iter([self.keys[i:i + per] for i in range(first * per, len(self.keys), per)])
        return Ahead(loader, self.make, first, 1)


# -- one measurement -------------------------------------------------------------------------
def build_trainer(p: Params, config, shapes: Shapes, data: SyntheticData, root: Path,
                  kernels: dict, tuned: dict, compile_blocks: bool):
    """A ``Trainer`` of ``p`` on a model of random weights, built as ``build_components``
    builds a run's model side; with its resolved profile."""
    device = resolve_device(p.train.device)
    batch = [(shapes.image_tokens, shapes.text + 3)] * shapes.per
    profile = resolve_profile(p, batch, device, config=config)
    engines = dataclasses.replace(engine_plan(p, device, memory=profile.engines),
                                  kernels=kernels, tuned=tuned)
    model = random_transformer(config, device, bf16_exact=True)
    parts = build_training(p, engines, model, device)
    if compile_blocks:  # each block with its adapters through torch.compile (dynamic tokens)
        from kohakumoss.memory import repeated_blocks

        blocks = [b for _, b in repeated_blocks(model)]
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 128)
        for block in blocks:
            block.compile(dynamic=True)
        model.engines.register(Handle("compiled blocks", blocks=tuple(blocks)))  # they run whole
    components = Components(**vars(parts), device=device, timesteps=None, plan=data, caches=data,
                            encoder=data, batches=data)
    paths = RunPaths(root / "plan", root / "catalog", root / "txt", root / "lat", root / "run")
    return Trainer(p, paths, components), profile


def measure(p: Params, config, shapes: Shapes, steps: int, rate: float, root: Path, *,
            kernels: dict, tuned: dict, chain: bool, cap: float, compile_blocks: bool,
            profiled: bool) -> dict:
    device = resolve_device(p.train.device)
    cuda = device.type == "cuda"
    data = SyntheticData(root, shapes, steps + 2 + profiled, device)
    gc.collect()  # the previous run's model (LyCORIS's wrappers hold cycles)
    if cuda:
        torch.cuda.empty_cache()
    trainer, profile = build_trainer(p, config, shapes, data, root, kernels, tuned, compile_blocks)
    model = trainer.model
    model.chain_adds = chain
    out = {"budget_samples": shapes.per, "profile": profile.name, "memory": profile.engines.describe(),
           "why": profile.why, "estimate_gib": profile.estimate.peak / 2**30, "chain": chain,
           "cap_gib": cap, "op_table": trainer.components.applied.kernels,
           "base": trainer.components.applied.quantized or "keep", "card": None}
    if cuda:  # the random weights were made on the card: a run that streams or quantizes
        gc.collect()  # them loads them on the host (build_components), so their freed
        torch.cuda.empty_cache()  # blocks leave the allocator's cache before the steps
    if cap and cuda:  # the allocator capped from here on (the model was built on the card uncapped)
        torch.cuda.set_per_process_memory_fraction(cap * 2**30 / torch.cuda.mem_get_info()[1])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    card = CardLog(torch.cuda.current_device()) if cuda else None
    times, held = [], 0.0
    ahead = data.ahead()
    try:
        with card or contextlib.nullcontext():
            for s in range(steps + 2):
                sync()
                t0 = time.perf_counter()
                trainer.step(s, ahead)
                sync()
                held = max(held, held_gib()) if cuda else 0.0
                if s >= 2:
                    times.append(time.perf_counter() - t0)
            trainer.stepper.wait()
    except torch.OutOfMemoryError as e:
        out.update(error="out of memory", detail=str(e).splitlines()[0][:200],
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30)
        return _released(out, trainer, cuda)
    layout = build_layout([(shapes.grid,) * 2] * shapes.per, [shapes.text] * shapes.per)
    t = statistics.median(times)
    flops = train_flops(config, layout, full=p.adapter.full)
    ring = model.engines.state("weight streaming")
    offloader = model.engines.state("activation offload")
    if profiled:
        out["profile_step"] = profile_step(lambda: trainer.step(steps + 2, ahead))
    out.update(step_s=t, step_times_s=[round(x, 4) for x in times], samples_per_s=shapes.per / t,
               model_tflops_per_step=flops / 1e12, mfu=flops / t / rate if rate else None,
               trainable_params=sum(x.numel() for x in trainer.stepper.tensors),
               host_peak_gib=host_peak_gib(), card=card.summary() if card else None)
    if cuda:
        out.update(peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                   reserved_gib=torch.cuda.max_memory_reserved() / 2**30, device_used_gib=held)
    if ring is not None:
        out.update(loads_per_step=ring.loads / (steps + 2 + profiled), host_weights_gib=ring.host_bytes() / 2**30)
    if offloader is not None:
        out["offloaded_gib_per_step"] = offloader.bytes / 2**30
    return _released(out, trainer, cuda)


def _released(out: dict, trainer: Trainer, cuda: bool) -> dict:
    trainer.components = trainer.model = trainer.trainable = trainer.stepper = trainer.optimizer = None
    gc.collect()
    if cuda:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    return out


def host_peak_gib() -> float:
    """The process's peak resident host memory (GiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def held_gib() -> float:
    """What the device holds beyond this process's allocator: CUDA context, cuBLAS
    workspaces, the allocator's reserve (GiB, from the driver's free memory)."""
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


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



def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=Path, default=PARAMS, help="the run's params file")
    ap.add_argument("-S", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="section.key=value over the params file (repeatable)")
    ap.add_argument("--variant", action="append", default=[], metavar="'KEY=VALUE ...'",
                    help="a set of overrides measured in turn, on top of -S (repeatable; a "
                         "variant may come twice: A B A B shows the card's drift)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[16800],
                    help="tokens a step holds (16,800: four 1 MP samples)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps (after 2 warm-up ones)")
    ap.add_argument("--text", type=int, default=100, help="caption tokens a sample")
    ap.add_argument("--grid", type=int, default=64, help="latent grid side (64: 1 MP)")
    ap.add_argument("--flavor", default="base", choices=sorted(FLAVORS), help="the model's size")
    ap.add_argument("--kernels", nargs="*", default=[],
                    help="backends to prefer for every op that has them, in order (fa4 triton "
                         "compile), or op=backend,backend; none: the references")
    ap.add_argument("--tune", action="store_true",
                    help="the per-shape ops (the block linears' GEMM) as the tuner picks them")
    ap.add_argument("--tune-backends", nargs="*", default=[],
                    help="with --tune: the backends it times (opt-in ones: tilelang)")
    ap.add_argument("--chain", nargs="+", choices=["on", "off"], default=["on"],
                    help="the joint blocks chained (the model's default) or block by block")
    ap.add_argument("--cap", type=float, nargs="+", default=[0.0],
                    help="cap the allocator at this many GiB for the steps (0: none)")
    ap.add_argument("--compile-blocks", action="store_true",
                    help="torch.compile each block with its adapters (dynamic token counts)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one step: kernels by CUDA time, shares by family")
    ap.add_argument("--name", default="", help="the report's file name under $OUT")
    a = ap.parse_args(argv)
    config = FLAVORS[a.flavor]
    variants = [shlex.split(v) for v in a.variant] or [[]]
    first = bench_params(a.params, a.overrides + variants[0])
    device = resolve_device(first.train.device)
    cuda = device.type == "cuda"
    kernels = kernel_choices(a.kernels)
    shapes = [Shapes(a.grid, a.text, max(1, b // (a.grid * a.grid + a.text + 3)), config.latent_channels,
                     config.text_dim) for b in a.budgets]
    # the allocator as the first variant's run sets it (once a process: before the model)
    first_profile = resolve_profile(first, [(a.grid * a.grid, a.text)] * shapes[0].per, device, config=config)
    expandable = tight_allocator(first_profile.engines, device)
    tuned = tune_per_shape([[(a.grid * a.grid, a.text)] * s.per for s in shapes], a.tune_backends,
                           config=config, device=device) if a.tune else {}
    rate = matmul_rate() if cuda else 0.0
    res = {"device": torch.cuda.get_device_name() if cuda else str(device), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "params": str(a.params), "overrides": a.overrides,
           "kernels": kernels, "tuned": bool(tuned), "expandable_segments": expandable,
           "compile_blocks": a.compile_blocks, "bf16_matmul_tflops": rate / 1e12, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        n = 0
        for cap in a.cap:
            for variant in variants:
                p = bench_params(a.params, a.overrides + variant)
                for chain in a.chain:
                    for shape, budget in zip(shapes, a.budgets):
                        n += 1
                        row = {"variant": " ".join(variant), "budget": budget,
                               **measure(p, config, shape, a.steps, rate, Path(tmp) / str(n),
                                         kernels=kernels, tuned=tuned, chain=chain == "on", cap=cap,
                                         compile_blocks=a.compile_blocks, profiled=a.profile)}
                        res["runs"].append(row)
                        print(json.dumps(row), flush=True)
    report(res, a.name or "bench_train")
    return res


if __name__ == "__main__":
    main()
