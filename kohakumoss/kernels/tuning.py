"""The tuner: per op, dtype and shape bucket, time every backend that can run and rank them.

What is timed: one training use of the op, forward then backward (``autograd.grad`` of the
output against a fixed random gradient, for the activations, and for the op's parameters in
a full finetune), on inputs of the bucket's largest planned shape
(``kohakumoss.kernels.problems``). Two warm-up calls, the first one's wall time kept (it
compiles what compiles: its excess over a call is the backend's build, ``build_ms``), then
the median of 5 to 50 timed calls (as many as fit in ~50 ms): CUDA events on a GPU,
``perf_counter`` on the CPU. A backend that raises is recorded as failed, with the reason,
and never ranked. A backend must beat the reference by ``MARGIN`` to rank before it (the
reference is exact, and a tie is noise), and, given the run's calls (``plan_calls``), save
the run more over the op's shapes than its builds there cost (``settle``): a short run on
small shapes keeps the reference rather than spend seconds compiling to save milliseconds.

``tune(problems, device, dtype, budget_s=...)`` spends at most ``budget_s`` seconds (checked
between measurements, so one compile may overrun it); an entry the budget cut short is not
recorded (it is "untuned": its calls follow the nearest measured shape, else the reference, until
a later run measures it). The
tuner draws its inputs from its own generator and restores the RNG states it found, so a
training run that tunes before step 0 draws the same numbers as one that does not.

``tune_table(directory, ...)`` is what ``kmoss tune_kernels`` runs: it keeps the entries
the table already holds for this device signature, measures the missing ones, and writes the
table and its manifest (``kohakumoss.kernels.table``).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from kohakumoss.artifacts import ArtifactError, Manifest
from kohakumoss.errors import IntegrityError
from kohakumoss.kernels.problems import PROBLEMS, Dims
from kohakumoss.kernels.dispatch import REFERENCE_NAME, REFERENCES, entry_key, failure_reason, parse_entry_key
from kohakumoss.kernels.registry import KERNELS, KernelRegistry
from kohakumoss.kernels.table import (DEVICE_FIELDS, TABLE, KernelTable, device_signature,
                                      read_table, signature_key, write_table)

log = logging.getLogger(__name__)

MARGIN = 0.03  # a backend must be 3% faster than the reference to rank before it
WARMUP = 2
REPEATS = (5, 50)
TARGET_S = 0.05  # timed calls per measurement: as many as fit in this, within REPEATS


@dataclasses.dataclass
class TuneResult:
    entries: dict[str, dict[str, Any]]  # entry key -> {"order", "ms", "failed", "shape"}
    seconds: float
    untuned: list[str]  # entry keys the budget left unmeasured

    @property
    def complete(self) -> bool:
        return not self.untuned


def wanted_entries(problems: Mapping[str, Mapping[str, Dims]], device: torch.device | str,
                   dtype: torch.dtype, *, allow: Sequence[str] | None = None,
                   registry: KernelRegistry = KERNELS) -> dict[str, tuple[str, Dims]]:
    """``{entry key: (op, dims)}`` for every shape of an op with a backend besides the
    reference that can run here: the entries a complete table holds (largest shapes first)."""
    out = {}
    for op, shapes in problems.items():
        if op not in PROBLEMS or not registry.eligible(op, device, dtype, allow):
            continue
        for key, dims in sorted(shapes.items(), key=lambda kv: -kv[1]["N"]):
            out[entry_key(op, dtype, key)] = (op, dict(dims))
    return out


def _timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    if device.type == "cuda":
        def cuda_ms(step):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        return cuda_ms

    def cpu_ms(step):
        t0 = time.perf_counter()
        step()
        return (time.perf_counter() - t0) * 1e3
    return cpu_ms


def time_forward_backward(fn: Callable, args: tuple, device: torch.device,
                          generator: torch.Generator) -> tuple[float, float]:
    """Milliseconds of ``fn(*args)`` plus its backward (see the module): the median, and the
    first call's wall time (with what it built: a compile, a kernel's JIT)."""
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = fn(*args)
    grad = torch.randn(out.shape, generator=generator, device=device).to(out.dtype)
    torch.autograd.grad(out, leaves, grad)
    sync()
    built = (time.perf_counter() - t0) * 1e3

    def step():
        torch.autograd.grad(fn(*args), leaves, grad)

    timer = _timer(device)
    for _ in range(WARMUP - 1):
        step()
    first = timer(step)
    n = min(max(int(TARGET_S * 1e3 / max(first, 1e-3)), REPEATS[0]), REPEATS[1])
    return statistics.median([first] + [timer(step) for _ in range(n - 1)]), built


def rank(ms: Mapping[str, float], demoted: Collection[str] = ()) -> list[str]:
    """Backend names fastest first; one not ``MARGIN`` faster than the reference, or
    ``demoted`` (its build costs the run more than it saves: ``settle``), goes after it."""
    ref = ms.get(REFERENCE_NAME)
    order = sorted(ms, key=lambda n: (ms[n], n != REFERENCE_NAME, n))
    if ref is None:
        return order
    ahead = [n for n in order if n != REFERENCE_NAME and n not in demoted
             and ms[n] < ref * (1 - MARGIN)]
    return ahead + [REFERENCE_NAME] + [n for n in order if n not in ahead and n != REFERENCE_NAME]


def settle(entries: Mapping[str, dict[str, Any]], calls: Mapping[str, Mapping[str, int]] | None
           ) -> bool:
    """Rank ``entries`` (entry key -> entry) for a run that makes ``calls`` (``plan_calls``).
    Per op, a backend whose builds over the op's entries (``build_ms``, summed: a process
    builds it once and rebuilds it for new shapes as the tuner did) cost more than it saves
    over the run's calls of the entries where it is faster goes after the reference in all
    of them; ``demoted`` records the two sums. True if an entry changed. Without ``calls``,
    nothing changes (the order is by time per call)."""
    if calls is None:
        return False
    groups: dict[str, list[tuple[dict[str, Any], int]]] = {}
    for key, entry in entries.items():
        parsed = parse_entry_key(key)
        if parsed is not None and entry.get("ms"):
            op, _, shape = parsed
            groups.setdefault(op, []).append((entry, calls.get(op, {}).get(shape, 0)))
    changed = False
    for group in groups.values():
        demoted = {}
        for name in sorted({n for e, _ in group for n in e["ms"]} - {REFERENCE_NAME}):
            saved = sum((e["ms"][REFERENCE_NAME] - e["ms"][name]) * n for e, n in group
                        if name in e["ms"] and REFERENCE_NAME in e["ms"]
                        and e["ms"][name] < e["ms"][REFERENCE_NAME] * (1 - MARGIN))
            built = sum((e.get("build_ms") or {}).get(name, 0.0) for e, _ in group)
            if built > saved:
                demoted[name] = {"saved_ms": round(saved, 3), "build_ms": round(built, 3)}
        for entry, n in group:
            settled = {"order": rank(entry["ms"], demoted), "calls": n, "demoted": demoted}
            changed |= any(entry.get(k) != v for k, v in settled.items())
            entry.update(settled)
    return changed


def measure(op: str, dims: Dims, device: torch.device, dtype: torch.dtype, names: Sequence[str],
            registry: KernelRegistry, expired: Callable[[], bool],
            weights_grad: bool = True) -> dict[str, Any] | None:
    """One entry: every backend in ``names`` (the reference first) timed on ``dims``, ranked
    by time per call (``settle`` ranks it for a run); None when ``expired()`` turned true
    before the last one was timed."""
    generator = torch.Generator(device=device).manual_seed(0)
    args = PROBLEMS[op].make(dims, dtype, device, generator, weights_grad)
    ms, build, failed = {}, {}, {}
    for name in names:
        if expired():
            return None
        b = None if name == REFERENCE_NAME else registry.backend(op, name)
        if b is not None and not b.takes(dims):
            failed[name] = "does not take this shape"
            continue
        fn = REFERENCES[op] if b is None else b.fn
        try:
            per_call, first = time_forward_backward(fn, args, device, generator)
            ms[name], build[name] = round(per_call, 4), round(max(0.0, first - per_call), 3)
        except torch.OutOfMemoryError as e:
            failed[name] = failure_reason(e)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        except Exception as e:  # a backend that cannot build or run here: never ranked
            failed[name] = failure_reason(e)
            registry.note(("tune-failed", op, name, str(dtype)),
                          f"{op}: backend {name} failed while tuning ({failed[name]}); not used",
                          logging.WARNING)
    return {"order": rank(ms), "ms": ms, "build_ms": build, "failed": failed, "shape": dims,
            "grads": "all" if weights_grad else "activations"}


def tune(problems: Mapping[str, Mapping[str, Dims]], device: torch.device | str,
         dtype: torch.dtype, *, budget_s: float, allow: Sequence[str] | None = None,
         have: Mapping[str, Any] | None = None, weights_grad: bool = True,
         calls: Mapping[str, Mapping[str, int]] | None = None,
         registry: KernelRegistry = KERNELS, clock: Callable[[], float] = time.monotonic
         ) -> TuneResult:
    """Measure every wanted entry not in ``have`` within ``budget_s`` seconds; the op's
    parameters take gradients when ``weights_grad`` (a full finetune), else only the
    activations do (an adapter run's frozen base). ``calls`` (``plan_calls``): the run's
    calls per op and shape key, which the measured entries are ranked for (``settle``;
    None: by time per call)."""
    device = torch.device(device)
    start = clock()
    todo = {k: v for k, v in wanted_entries(problems, device, dtype, allow=allow,
                                            registry=registry).items() if k not in (have or {})}
    entries, untuned = {}, []

    def expired() -> bool:
        return clock() - start >= budget_s

    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        for key, (op, dims) in todo.items():
            names = [REFERENCE_NAME] + [b.name for b in registry.eligible(op, device, dtype, allow)]
            entry = None if expired() else measure(op, dims, device, dtype, names, registry,
                                                   expired, weights_grad)
            if entry is None:
                untuned.append(key)
            else:
                entries[key] = entry
    settle(entries, calls)
    return TuneResult(entries, round(clock() - start, 3), untuned)


def tune_table(directory: str | Path, problems: Mapping[str, Mapping[str, Dims]],
               device: torch.device | str, dtype: torch.dtype, *, budget_s: float,
               allow: Sequence[str] | None = None, weights_grad: bool = True,
               calls: Mapping[str, Mapping[str, int]] | None = None,
               params: dict[str, Any], inputs: dict[str, Manifest],
               registry: KernelRegistry = KERNELS) -> tuple[dict[str, Any], TuneResult, Manifest]:
    """Bring ``directory``'s table up to date for this device and ``problems``: keep what it
    holds for this signature, measure the missing entries, rank the plan's entries for its
    ``calls`` (``settle``), drop sections measured on this device with other software or
    kernel sources. Returns (this device's section, what was measured now, the manifest)."""
    directory = Path(directory)
    signature = device_signature(device)
    table = KernelTable()
    if (directory / TABLE).is_file() or (directory / "manifest.json").is_file():
        try:
            table = read_table(directory)
        except (ArtifactError, IntegrityError) as e:
            log.warning("%s; measuring everything again", e)
    stale = [k for k, s in table.devices.items()
             if k != signature_key(signature)
             and all(s["signature"].get(f) == signature[f] for f in DEVICE_FIELDS)]
    for k in stale:
        del table.devices[k]
    section = table.section(signature)
    new = section is None
    if new:
        section = {"signature": signature, "entries": {}, "tuning": {}}
        table.devices[signature_key(signature)] = section
    result = tune(problems, device, dtype, budget_s=budget_s, allow=allow, have=section["entries"],
                  weights_grad=weights_grad, calls=calls, registry=registry)
    section["entries"].update(result.entries)
    wanted = wanted_entries(problems, device, dtype, allow=allow, registry=registry)
    reranked = settle({k: e for k, e in section["entries"].items() if k in wanted}, calls)
    run = {"seconds": result.seconds, "budget_s": budget_s, "measured": len(result.entries),
           "untuned": len(result.untuned)}
    tuning = section.setdefault("tuning", {})
    if new:
        tuning["first_run"] = run
    if new or result.entries or result.untuned:
        tuning["last_run"] = run
        tuning["total_seconds"] = round(tuning.get("total_seconds", 0.0) + result.seconds, 3)
    changed = new or reranked or bool(stale) or bool(result.entries) or bool(result.untuned)
    info = {"device": signature["name"], "entries": len(section["entries"]),
            "untuned": len(result.untuned), "first_run_seconds": tuning["first_run"]["seconds"]}
    manifest = write_table(directory, table, params=params, inputs=inputs, info=info, write=changed)
    return section, result, manifest


def summary(section: dict[str, Any], dtype: torch.dtype | None = None) -> list[dict[str, Any]]:
    """Per op: the shapes tuned, each winner, its speedup over the reference, and why the
    reference won where a backend was faster per call (``build_note``)."""
    rows: dict[str, dict[str, Any]] = {}
    for key, entry in sorted(section["entries"].items()):
        parsed = parse_entry_key(key)
        if parsed is None or (dtype is not None and parsed[1] != dtype):
            continue
        op, dt, shape = parsed
        row = rows.setdefault(op, {"op": op, "shapes": []})
        ms = entry["ms"]
        best = entry["order"][0] if entry["order"] else REFERENCE_NAME
        ref = ms.get(REFERENCE_NAME)
        speedup = round(ref / ms[best], 2) if ref and ms.get(best) and best != REFERENCE_NAME \
            else None
        row["shapes"].append({"dtype": str(dt).removeprefix("torch."), "shape": shape,
                              "winner": best, "speedup": speedup, "ms": ms,
                              "failed": entry.get("failed", {}), "note": build_note(entry)})
    return list(rows.values())


def build_note(entry: dict[str, Any]) -> str | None:
    """Where ``settle`` put the reference before a backend that runs this entry faster per
    call: that the backend's builds cost the run more than it saves (else None)."""
    ms, ref = entry["ms"], entry["ms"].get(REFERENCE_NAME)
    if not entry["order"] or entry["order"][0] != REFERENCE_NAME or not ref:
        return None
    quick = [n for n in entry.get("demoted") or {} if n in ms and ms[n] < ref * (1 - MARGIN)]
    if not quick:
        return None
    n = min(quick, key=ms.get)
    d = entry["demoted"][n]
    return (f"{n} is {ref / ms[n]:.2f}x per call, but building it for this op's shapes "
            f"({d['build_ms'] / 1e3:.1f} s) costs more than the {d['saved_ms'] / 1e3:.2f} s it "
            f"saves over the run's calls")
