"""The memory catalog (``kmoss profiles``, ``docs/memory.md#the-catalog``): every valid
combination of the memory engines for a run's model, adapter and token budget, each with
the estimator's peak on the device and in host memory and its step time relative to
``speed``'s, sorted fastest first. The named profiles are rows of it.

A combination is valid when ``params`` would accept it as a ``manual`` profile (the same
checks, ``params.check_memory`` / ``check_precision`` / ``check_optimizer``) and a CUDA
device places it as it is (``estimate.placed`` changes nothing). The step time is the
measured factor of ``docs/performance.md``'s profile table where the combination is a
named profile, else the cost model of ``memory.profiles.slowdown`` (its constants are those
measurements too).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from kohakumoss.config import MemoryConfig, Params
from kohakumoss.configlib import ConfigError
from kohakumoss.memory.profiles import PROFILE_ENGINES, MemoryEngines, slowdown
from kohakumoss.quant import quant_plan
from kohakumoss.training.estimate import Estimate, _meta_model, estimate, placed

# samples/s of each named profile against ``speed`` (rank-32 LoRA at 1 MP, 4 samples a step,
# 1x H200, 2026-12-03, 008f4d0: docs/performance.md#memory-profiles)
MEASURED = {"speed": 1.0, "balanced": 0.943, "low": 0.766, "minimal": 0.780}
PARTIAL_STEPS = 6  # partial checkpointing's block counts: depth / 6 apart
SLOTS = (0, 1, 2, 4)
BASES = ("keep", "int8", "fp8")


@dataclasses.dataclass(frozen=True)
class Row:
    engines: MemoryEngines
    base: str  # precision.base
    estimate: Estimate
    speed: float  # samples/s against speed's (1.0: as fast)
    measured: bool  # ``speed`` is docs/performance.md's figure, not the cost model's
    name: str = ""  # the named profile this row is, if any

    @property
    def peak(self) -> int:
        return self.estimate.peak

    @property
    def host(self) -> int:
        return self.estimate.host


def _manual(p: Params, e: MemoryEngines, base: str) -> Params:
    memory = MemoryConfig(e.checkpointing, e.checkpoint_blocks, e.recompute, e.stream_slots,
                          e.optimizer, e.offload, e.rebuild, e.fp8_transposes)
    precision = dataclasses.replace(p.precision, base=base) if base != p.precision.base else p.precision
    return dataclasses.replace(p, profile="manual", memory=memory, precision=precision)


def accepted(p: Params, engines: MemoryEngines, base: str) -> bool:
    """Whether ``params`` takes ``engines`` with ``precision.base: base`` as a manual profile
    and a CUDA device places them unchanged."""
    from kohakumoss.params import check_memory, check_optimizer, check_precision

    q = _manual(p, engines, base)
    try:
        check_memory(q)
        check_precision(q)
        check_optimizer(q)
    except ConfigError:
        return False
    return placed(engines, q, torch.device("cuda"))[0] == engines


def combinations(p: Params, depth: int) -> Iterator[tuple[MemoryEngines, str]]:
    """Every combination of the engines' knobs (partial checkpointing every ``depth / 6``
    blocks), valid or not."""
    partial = sorted({max(1, round(depth * i / PARTIAL_STEPS)) for i in range(1, PARTIAL_STEPS)})
    modes = [("none", 0), ("selective", 0), ("block", 0), ("sub-block", 0)] + \
        [("partial", k) for k in partial]
    bases = BASES if p.precision.base in BASES else (p.precision.base,)
    transposes = (False, True)
    for (mode, k), recompute, slots, optimizer, offload, rebuild, fp8t, base in itertools.product(
            modes, (True, False), SLOTS, ("device", "host", "streamed", "fused"), (False, True),
            (False, True), transposes, bases):
        yield MemoryEngines(mode, k, recompute, slots, optimizer, offload, rebuild,
                            fp8_transposes=fp8t), base


def _named(p: Params, engines: MemoryEngines) -> str:
    """The named profile these engines are for this run (as a CUDA device places it)."""
    cuda = torch.device("cuda")
    return next((n for n, e in PROFILE_ENGINES.items() if placed(e, p, cuda)[0] == engines), "")


def catalog(p: Params, batch: Sequence[tuple[int, int]], config=None) -> list[Row]:
    """The valid combinations for ``params`` at ``batch`` (a micro-batch's (image, text)
    token counts), fastest first (a tie: the smaller peak first)."""
    models: dict[str, tuple] = {}
    rows = []
    for engines, base in combinations(p, (config or _config(p)).depth):
        if not accepted(p, engines, base):
            continue
        q = _manual(p, engines, base)
        key = f"{base}/{engines.recompute}"
        if key not in models:  # one meta model per base precision and recompute
            models[key] = _meta_model(q, engines, config)
        est = estimate(q, batch, engines, config, _model=models[key])
        name = _named(p, engines) if base == p.precision.base else ""
        measured = name in MEASURED
        # the codes' transposes cost only where there are fp8 codes to transpose
        timed = engines if quant_plan(q.precision).keeps_transposes else \
            dataclasses.replace(engines, fp8_transposes=True)
        speed = MEASURED[name] if measured else 1 / (1 + slowdown(timed, models[key][0].config.depth))
        rows.append(Row(engines, base, est, speed, measured, name))
    rows.sort(key=lambda r: (-r.speed, r.peak))
    return rows


def fitting(rows: Sequence[Row], vram: float | None = None, ram: float | None = None) -> list[Row]:
    """The rows whose device peak fits ``vram`` GiB and host memory ``ram`` GiB."""
    return [r for r in rows if (vram is None or r.peak <= vram * 2**30)
            and (ram is None or r.host <= ram * 2**30)]


def typical_batch(p: Params, plan: Path | None = None) -> tuple[list[tuple[int, int]], str]:
    """The micro-batch the catalog estimates, and what it is: the plan's largest when
    ``plan`` holds one, else ``batching.max_tokens`` filled with samples of
    ``resolution.target_area`` and a typical caption (``kmoss config``'s)."""
    if plan is not None and (Path(plan) / "manifest.json").is_file():
        from kohakumoss.data.planfile import read_plan
        from kohakumoss.training.engines import plan_token_batches

        from kohakumoss.training.build import largest_batch

        batch = largest_batch(plan_token_batches(read_plan(plan)[0]))
        if batch:
            return list(batch), f"the plan's largest micro-batch ({sum(i + t for i, t in batch)} tokens)"
    image = max(16, int(p.resolution.target_area) // 256)
    samples = max(1, int(p.batching.max_tokens) // (image + TYPICAL_TEXT))
    return [(image, TYPICAL_TEXT)] * samples, (f"{samples} sample(s) of {image} image and "
                                               f"{TYPICAL_TEXT} text tokens")


TYPICAL_TEXT = 104  # a typical caption's text tokens


def _config(p: Params):
    from kohakumoss.checks.params import transformer_config

    return transformer_config(p)
