"""``profile: auto`` and the named profiles, resolved for a run: the fastest engines whose
memory estimate (``kohakumoss.training.estimate``) fits the memory the device has free, in
the order ``kohakumoss.memory.profiles.slowdown`` predicts (``speed``; ``balanced``'s
rebuilt outputs; ``partial`` checkpointing of 1, 2, ... blocks; on CUDA, checkpointing with
activation offload, ``minimal`` and ``low``; ``block``), and why (``docs/memory.md, "The estimator"``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import torch

import kohakumoss.portable as portable
from kohakumoss.config import Params
from kohakumoss.memory.checkpointing import repeated_blocks
from kohakumoss.memory.profiles import PROFILES_BY_MEMORY, PROFILE_ENGINES, MemoryEngines, slowdown
from kohakumoss.model.config import DiTConfig
from kohakumoss.parallel.split import Split, StageCosts, plan_split
from kohakumoss.training.estimate import Estimate, _meta_model, estimate, placed, size

HEADROOM = 0.92  # auto keeps this share of the free memory for the step (allocator slack)


def free_memory(device: torch.device) -> int:
    """Bytes the device has free now: CUDA's free memory, or the host's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return portable.available_ram()


def profile_engines(params: Params) -> MemoryEngines:
    """The engines of ``params.profile`` (``manual``: the ``memory:`` section). ``auto`` is
    resolved against free memory by ``resolve_profile``."""
    if params.profile == "manual":
        m = params.memory
        return MemoryEngines(m.checkpointing, m.checkpoint_blocks, m.recompute, m.stream_slots,
                             m.optimizer, m.offload, m.rebuild, fp8_transposes=m.fp8_transposes)
    if params.profile == "auto":
        raise ValueError("profile auto is resolved against the device's free memory "
                         "(resolve_profile)")
    return PROFILE_ENGINES[params.profile]


def _host_note(est: Estimate, host_free: int) -> str:
    if est.host <= host_free * HEADROOM:
        return ""
    return (f"; its engines need {size(est.host)} of host memory and {size(host_free)} is "
            f"available: it may run out of host memory (close other programs, add swap, or "
            f"choose a profile that streams less)")


def _fill_resident(params: Params, batch, engines: MemoryEngines, est: Estimate, built,
                   budget: int) -> tuple[MemoryEngines, Estimate]:
    """A streamed adapter run that fits with room to spare: the most leading blocks whose
    weights stay on the device within ``budget`` (each one streamed is two host copies a
    step that the link may not hide: one sample per step is bound by them)."""
    if not engines.stream_slots or params.adapter.full:
        return engines, est
    lo, hi = 0, len(repeated_blocks(built[0])) - 1  # at least one block streams
    best = (engines, est)
    while lo < hi:  # the peak grows with each resident block: the largest count that fits
        k = (lo + hi + 1) // 2
        wider = dataclasses.replace(engines, resident_blocks=k)
        wide = estimate(params, batch, wider, _model=built)
        if wide.peak <= budget:
            lo, best = k, (wider, wide)
        else:
            hi = k - 1
    return best


class Profile(NamedTuple):
    """A run's resolved memory profile."""

    name: str  # the profile (``auto``: a candidate that is no named profile)
    engines: MemoryEngines  # as this run can place them (``placed``)
    estimate: Estimate | None  # the step's predicted memory (None: no batch to estimate)
    why: str  # one line a run logs


def device_split(params: Params, batch: Sequence[tuple[int, int]], engines: MemoryEngines,
                 devices: Sequence[torch.device], free: Sequence[int] | None = None,
                 config: DiTConfig | None = None, models: tuple | None = None) -> Split:
    """The joint blocks' split over ``devices`` for a step on ``batch`` (``parallel.mode:
    threaded``): ``HEADROOM`` of each device's free memory (``free``: now) against the
    estimate's per-device share (``stage_costs``)."""
    if free is None:
        free = [int(free_memory(d) * HEADROOM) for d in devices]
    return plan_split(stage_costs(params, batch, engines, config, models), devices, free)


def resolve_profile(params: Params, batch: Sequence[tuple[int, int]] | None, device: torch.device,
                    free: int | None = None, config: DiTConfig | None = None,
                    host_free: int | None = None,
                    devices: Sequence[torch.device] | None = None,
                    device_free: Sequence[int] | None = None) -> Profile:
    """The one place ``profile`` is resolved: the params' profile as it is (``manual``: the
    ``memory:`` section), or for ``auto`` the fastest engines whose estimate at ``batch`` (a
    micro-batch's ``(image, text)`` token counts) fits ``HEADROOM`` of the free memory
    (``free``, default: the device's now) and whose host memory fits ``HEADROOM`` of the
    host's available RAM (``host_free``, default: now); either as ``placed`` on ``device``.
    ``why`` warns when the host memory the engines need is not there. ``batch`` None (no
    plan yet, or an estimate that failed): nothing is estimated and ``auto`` is ``speed``.
    ``devices``: a threaded run's devices, where ``auto`` asks that the split fits
    ``HEADROOM`` of each one's free memory (``device_free``, default: now; ``device_split``)."""
    if batch is None:
        name = "speed" if params.profile == "auto" else params.profile
        engines, note = placed(PROFILE_ENGINES["speed"] if name == "speed" and params.profile == "auto"
                               else profile_engines(params), params, device)
        return Profile(name, engines, None, f"profile {params.profile}"
                       + (" (no estimate: speed)" if params.profile == "auto" else "")
                       + (f": {note}" if note else ""))
    host_free = free_memory(torch.device("cpu")) if host_free is None else host_free
    if params.profile != "auto":
        engines, note = placed(profile_engines(params), params, device)
        est = estimate(params, batch, engines, config)
        return Profile(params.profile, engines, est, f"profile {params.profile}"
                       + (f": {note}" if note else "") + _host_note(est, host_free))
    free = free_memory(device) if free is None else free
    budget = int(free * HEADROOM)
    room = None if not devices else [int(f * HEADROOM) for f in (
        device_free if device_free is not None else [free_memory(d) for d in devices])]

    models = None

    def fits(engines: MemoryEngines, est: Estimate) -> bool:
        nonlocal models
        if room is None:
            return est.peak <= budget
        if models is None:  # the speed engines' meta models serve every candidate (as ``built``)
            models = (built, split_models(params, PROFILE_ENGINES["speed"], config)[1])
        return device_split(params, batch, engines, devices, room, config, models).fits
    built = _meta_model(params, PROFILE_ENGINES["speed"], config)
    depth = built[0].config.depth
    speed = placed(PROFILE_ENGINES["speed"], params, device)[0]
    candidates = [("speed", speed), ("auto", MemoryEngines("block"))]
    if speed.fp8_transposes:  # fp8 compute full: speed less its kept transposes
        candidates.append(("auto", dataclasses.replace(speed, fp8_transposes=False)))
    candidates += [("auto", MemoryEngines("partial", k, rebuild=True)) for k in range(1, depth)]
    seen = {MemoryEngines("block")}
    # the named profiles, then checkpointing with activation offload and resident weights
    # (on CUDA: the recomputation replays the attention); what this run cannot place
    # (streaming or offload on the CPU) drops out
    named = [(name, PROFILE_ENGINES[name]) for name in PROFILES_BY_MEMORY[1:]]
    for name, wanted in named + [("auto", MemoryEngines(m, offload=True)) for m in ("sub-block", "block")]:
        engines = placed(wanted, params, device)[0]
        if engines.stream_slots and params.precision.base != "keep":
            continue  # a quantized base does not stream yet
        if engines not in seen:
            seen.add(engines)
            candidates.append((name, engines))
    candidates.sort(key=lambda c: slowdown(c[1], depth))  # stable: a tie keeps this order
    estimates = {}
    for name, engines in candidates:
        est = estimates[engines] = estimate(params, batch, engines, _model=built)
        if fits(engines, est) and not _host_note(est, host_free):
            engines, est = _fill_resident(params, batch, engines, est, built, budget)
            fitted = (f"{size(budget)} ({HEADROOM:.0%} of {size(free)} free on {device})" if room is None
                      else f"split over {', '.join(map(str, devices))} ({HEADROOM:.0%} of "
                           f"{', '.join(size(r / HEADROOM) for r in room)} free)")
            why = (f"profile auto: {name if name != 'auto' else engines.describe()} is the fastest "
                   f"whose {size(est.peak)} estimate fits {fitted}"
                   + (f", with the first {engines.resident_blocks} blocks' weights resident (fewer "
                      f"copies a step)" if engines.resident_blocks and name != "auto" else ""))
            return Profile(name, engines, est, why)
    name, engines = min(candidates, key=lambda c: estimates[c[1]].peak)  # the leanest
    est = estimates[engines]
    why = (f"profile auto: nothing fits {size(budget)} ({HEADROOM:.0%} of {size(free)} free on "
           f"{device}); running {name}, the leanest, at {size(est.peak)} estimated: it may run "
           f"out of memory (lower batching.max_tokens)" + _host_note(est, host_free))
    return Profile(name, engines, est, why)


def stage_costs(params: Params, batch: Sequence[tuple[int, int]], engines: MemoryEngines,
                config: DiTConfig | None = None, models: tuple | None = None) -> StageCosts:
    """The step's predicted bytes by where a device split puts them
    (``kohakumoss.parallel.split``): each joint block's share (the estimate of the model less
    that of the model one block shorter; under ``partial`` checkpointing its first blocks
    at ``block``'s share, the rest at ``none``'s), the rest on the first device, the
    backward's working set on the others. ``models``: the two meta models
    (``split_models``), built once where many engines are tried."""
    from kohakumoss.checks.params import transformer_config

    c = config or transformer_config(params)
    built, short = models if models is not None else (None, None)
    whole = estimate(params, batch, engines, c, _model=built)
    if c.depth == 1:
        return StageCosts((whole.peak - whole.transient,), whole.transient, whole.transient)
    less = dataclasses.replace(c, depth=c.depth - 1)

    def share(e: MemoryEngines) -> int:
        return estimate(params, batch, e, c, _model=built).peak - estimate(params, batch, e, less, _model=short).peak

    if engines.checkpointing == "partial":
        k = min(engines.checkpoint_blocks, c.depth)
        per = (share(dataclasses.replace(engines, checkpointing="block")),) * k + \
            (share(dataclasses.replace(engines, checkpointing="none")),) * (c.depth - k)
    else:
        per = (share(engines),) * c.depth
    return StageCosts(per, whole.peak - sum(per), whole.transient)


def split_models(params: Params, engines: MemoryEngines, config: DiTConfig | None = None) -> tuple:
    """The meta models ``stage_costs`` estimates, the whole and one joint block shorter."""
    from kohakumoss.checks.params import transformer_config

    c = config or transformer_config(params)
    return (_meta_model(params, engines, c),
            _meta_model(params, engines, dataclasses.replace(c, depth=c.depth - 1)) if c.depth > 1 else None)
