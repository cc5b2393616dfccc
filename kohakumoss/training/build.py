"""Everything a training run is made of, built from params and paths before the loop
starts: the model with its engines applied, what is trained, the optimiser, schedule and
EMA, the timestep distribution, the caches and encoders, the plan's batches.

``build_components(params, paths)`` builds them in this order; ``Trainer(params, paths,
components)`` only runs them. A test or a tool that wants a component built differently
builds the rest with this and replaces that one field.
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kohakumoss.artifacts import Manifest, atomic_write_json
from kohakumoss.cache.build import check_sources, text_identity, vae_identity
from kohakumoss.cache.lookup import BatchCaches
from kohakumoss.config import Params
from kohakumoss.data.catalogset import load_catalogs
from kohakumoss.data.loader import PlanBatches
from kohakumoss.data.planfile import read_plan
from kohakumoss.device import resolve_device
from kohakumoss.diffusion.timesteps import LogitNormalTimesteps, MossTimesteps, UniformTimesteps
from kohakumoss.formats import load_dit
from kohakumoss.formats.model_files import stored_weights
from kohakumoss.kernels.table import device_signature
from kohakumoss.memory.allocator import tight_allocator
from kohakumoss.memory.host_copies import NodeCopies
from kohakumoss.memory.host_update import HostUpdate
from kohakumoss.memory.overlap import OverlappedUpdate
from kohakumoss.memory.profiles import MemoryEngines
from kohakumoss.memory.stepping import FusedStep, StreamedStates
from kohakumoss.model.dit import MOSSImageTransformer
from kohakumoss.parallel import Dist, barrier, parallel_mode
from kohakumoss.parallel.split import Split, apply_device_split, split_devices
from kohakumoss.precision.scaler import loss_scaler
from kohakumoss.training.ema import EMA
from kohakumoss.training.encode import BatchEncoder
from kohakumoss.training.autoprofile import HEADROOM, device_split, resolve_profile
from kohakumoss.training.estimate import size
from kohakumoss.training.engines import (AppliedEngines, EnginePlan, apply_engines, apply_placement,
                                         engine_plan,
                                         plan_token_batches, tuned_kernels)
from kohakumoss.training.inputs import make_timesteps
from kohakumoss.training.optim import build_optimizer, build_scheduler
from kohakumoss.optimizers import optimizer_kind
from kohakumoss.training.steppers import Stepper, make_stepper
from kohakumoss.training.trainable import Trainable, make_trainable


log = logging.getLogger(__name__)


@dataclasses.dataclass
class RunPaths:
    plan: Path
    catalog: Path
    text_cache: Path
    latent_cache: Path
    run: Path
    kernels: Path | None = None  # the tuning table's folder; None: reference kernels, no tuning

    @property
    def checkpoints(self) -> Path:
        return self.run / "checkpoints"




RUN_KERNELS = "kernels.json"  # runs/<name>/: the op-table choices the run trains with


def run_kernels(path: Path, engines: EnginePlan, plan_hash: str,
                choose: Callable[[], dict[str, list[str]]]) -> dict[str, list[str]]:
    """The run's kernel choices, fixed for its whole life: a resumed run reuses the choices
    its first start made (kept in ``runs/<name>/kernels.json``), because choices measured
    at train time depend on timing, and a resumed run must compute what an uninterrupted
    one does, bit for bit. They are made again only for another device, other kernel
    sources, another compute dtype or another plan."""
    key = {"signature": device_signature(engines.device), "plan": plan_hash,
           "dtype": str(engines.precision.compute)}
    if path.is_file():
        try:
            kept = json.loads(path.read_text(encoding="utf-8"))
            if kept.get("key") == key and isinstance(kept.get("choices"), dict):
                log.info("kernel choices of this run kept in %s", path)
                return {k: list(v) for k, v in kept["choices"].items()}
        except ValueError:
            log.warning("%s is unreadable; the kernel choices are made again", path)
    choices = choose()
    atomic_write_json(path, {"key": key, "choices": choices})
    return choices


def largest_batch(batches: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    return max(batches, key=lambda b: sum(i + t for i, t in b), default=[])


def run_split(params: Params, batches: list[list[tuple[int, int]]], memory: MemoryEngines,
              devices: Sequence[torch.device]) -> Split:
    """A threaded run's split of the joint blocks over ``devices`` for the plan's largest
    micro-batch (``parallel/split.py``), logged; one that does not fit is a warning (the
    estimate is advice)."""
    split = device_split(params, largest_batch(batches), memory, devices)
    log.info("parallel.mode threaded: %s", split.describe())
    if not split.fits:
        log.warning("the split's predicted peaks exceed %d%% of the free memory on some "
                    "device: it may run out of memory (lower batching.max_tokens, or choose a "
                    "profile that checkpoints more)", round(HEADROOM * 100))
    return split


def run_memory(params: Params, batches: list[list[tuple[int, int]]],
               device: torch.device, devices: Sequence[torch.device] | None = None) -> MemoryEngines:
    """The memory engines of the run's profile (``auto``: resolved against the device's free
    memory), with the estimate for the plan's largest micro-batch logged; the allocator set
    for them (``tight_allocator``) before the model comes to the device."""
    batch = largest_batch(batches)
    try:
        profile = resolve_profile(params, batch, device, devices=devices)
    except Exception as e:  # the estimate is advice: a run never fails for want of it
        profile = resolve_profile(params, None, device)
        log.warning("no memory estimate (%s: %s); running %s", type(e).__name__, e,
                    profile.engines.describe())
    else:
        log.info("%s", profile.why)
        log.info("memory: %s", profile.estimate.describe())
    memory = profile.engines
    tight_allocator(memory, device)
    return memory


def node_copies(dist: Dist, device: torch.device, params: Params) -> NodeCopies | None:
    """The node's one shared host copy of a streamed frozen base, for a data-parallel run on
    CUDA (``memory/host_copies.py``); None for one process (its own page-locked copies)."""
    if not dist.group or device.type != "cuda":
        return None
    run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT", "")
    return NodeCopies(f"{params.run.name}-{getpass.getuser()}-{run}", dist.local_rank == 0,
                      lambda: barrier(dist), pin=True)


@dataclasses.dataclass
class Training:
    """The model side of a run (``build_training``): what trains and how it steps."""

    engines: EnginePlan
    applied: AppliedEngines
    model: MOSSImageTransformer
    trainable: Trainable
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ema: EMA | None
    stepper: Stepper  # how gradients become the update (memory.optimizer, parallel)


@dataclasses.dataclass
class Components(Training):
    """A run: its model side (``Training``) and its data side."""

    device: torch.device
    timesteps: MossTimesteps | UniformTimesteps | LogitNormalTimesteps
    plan: Manifest  # the plan's manifest: its content hash names the data order
    caches: BatchCaches
    encoder: BatchEncoder
    batches: PlanBatches
    dist: Dist = Dist()  # this process among the data-parallel ones


def build_training(params: Params, engines: EnginePlan, model: MOSSImageTransformer,
                   device: torch.device, dist: Dist = Dist(), offloaded: bool = False,
                   stored: Callable | None = None, split: Split | None = None) -> Training:
    """A built base ``model`` made into what a run trains, in ``build_components``' order:
    the engines applied (``stored``: a quantized checkpoint's weights by name), the
    sharding of a full finetune over ranks (``offloaded``: FSDP2's host offload), the
    trainable set, the host masters (``memory.optimizer: host``), placement, the optimizer,
    schedule, EMA and the stepper. A benchmark builds a run's model side with this on a
    model of random weights (``bench/bench_train.py``)."""
    p = params
    sharded = bool(dist.group) and parallel_mode(p) == "fsdp"
    applied = apply_engines(model, engines, stored)
    if sharded:  # before the trainable set: sharding replaces the parameters
        from kohakumoss.memory import repeated_blocks
        from kohakumoss.parallel.fsdp import shard_model

        shard_model(model, [b for _, b in repeated_blocks(model)], device, dist.world, offloaded)
    if split is not None:  # parallel.mode threaded: each block on its device, before the
        apply_device_split(model, split)  # adapters are built beside their weights
    trainable = make_trainable(model, p)
    named = trainable.named_parameters()
    update = None
    if engines.memory.optimizer == "host":  # the optimizer, clipping and EMA on host masters
        # (taken before placement: a streamed full finetune holds its blocks in bf16 after it)
        # an adapter's update runs beside the next forward, block by block (a full
        # finetune's streamed blocks take theirs through the weight ring: not overlapped)
        if p.adapter.full:
            update = HostUpdate(named, device)
        else:  # LyCORIS (and torch._dynamo with it) loads only for an adapter run
            from kohakumoss.adapters.inject import lora_name
            update = OverlappedUpdate(named, device, model, renamed=lora_name)
        named = update.named_masters
        log.info("optimizer on the host: %d tensors (%s of masters, gradients and landing "
                 "buffers in host memory); the device keeps no gradient or optimizer state",
                 len(named), size(update.host_bytes()))
    apply_placement(model, trainable, engines, applied, node_copies(dist, device, p))
    ring = model.engines.state("weight streaming")
    if update is not None and ring is not None:
        update.before_push.append(ring.invalidate)
    optimizer = build_optimizer(named, p.optim, trainable.lr_scale())
    if update is not None:
        update.attach(optimizer)
    scheduler = build_scheduler(optimizer, p.optim, p.train.steps)
    ema = EMA(named, p.optim.ema, device=None if update else device) if p.optim.ema > 0 else None
    stepper = make_stepper(
        optimizer, named, trainable, p.optim.grad_clip, model=model, ema=ema, dist=dist,
        scaler=loss_scaler(p.precision, engines.precision.compute), host=update, sharded=sharded,
        averaged=optimizer_kind(p.optim.name).averages,
        fused=FusedStep(named, optimizer) if engines.memory.optimizer == "fused" else None,
        streamed=StreamedStates(named, optimizer, device) if engines.memory.optimizer == "streamed" else None)
    return Training(engines, applied, model, trainable, optimizer, scheduler, ema, stepper)


def build_components(params: Params, paths: RunPaths,
                     engines: EnginePlan | None = None, dist: Dist = Dist()) -> Components:
    """The run's components; ``engines`` defaults to ``engine_plan(params, device)``. With
    ``paths.kernels`` (and no tuned choices in ``engines``) the op table follows the tuning
    table there, the shapes it lacks measured first (``tuned_kernels``). ``dist``: this
    process among the data-parallel ones (``kohakumoss.parallel``): the batches it reads."""
    p = params
    device = resolve_device(p.train.device)
    plan_rows, plan = read_plan(paths.plan)
    devices = split_devices(p.parallel.devices, device) if parallel_mode(p) == "threaded" else None
    engines = engines if engines is not None else engine_plan(p, device, memory=run_memory(
        p, plan_token_batches(plan_rows), device, devices))
    sharded = bool(dist.group) and parallel_mode(p) == "fsdp"
    offloaded = sharded and engines.memory.optimizer == "host"
    if offloaded:  # FSDP2 keeps each rank's shard on the host and gathers the blocks itself
        engines = dataclasses.replace(engines, memory=dataclasses.replace(
            engines.memory, optimizer="device", stream_slots=0, resident_blocks=0))
        log.info("sharded full finetune with the optimizer on the host: FSDP2 offloads each "
                 "rank's 1/%d of the masters, gradients and optimizer states to host memory and "
                 "gathers each block onto the device for its forward and backward", dist.world)
    # loaded straight in the dtype the precision policy holds the weights in (on the host when
    # its block weights will stream or be quantized: the device never holds them all)
    quantized = engines.precision.base != "keep"
    model = load_dit(p.model.transformer, engines.precision.weights, torch.device("cpu")
                     if engines.memory.stream_slots or quantized or offloaded or devices else device)
    if paths.kernels is not None and not engines.tuned:
        engines = dataclasses.replace(engines, tuned=run_kernels(
            paths.run / RUN_KERNELS, engines, plan.content_hash,
            lambda: tuned_kernels(p, engines, paths.kernels, model.config,
                                  plan_token_batches(plan_rows))))
    parts = build_training(p, engines, model, device, dist, offloaded,
                           stored_weights(p.model.transformer) if quantized else None,
                           run_split(p, plan_token_batches(plan_rows), engines.memory, devices)
                           if devices else None)
    timesteps = make_timesteps(p)
    check_sources(p, paths.text_cache, paths.latent_cache)
    caches = BatchCaches(p, load_catalogs(paths.catalog, p.data.datasets), paths.text_cache,
                         paths.latent_cache, text_identity(p), vae_identity(p))
    encoder = BatchEncoder(p, caches, device)
    batches = PlanBatches(paths.plan, p.data.datasets, p.resolution, paths.catalog,
                          rank=dist.rank, world=dist.world, plan_world=p.parallel.world_size,
                          pixels=p.cache.latents != "offline", max_pixels=p.data.max_image_pixels)
    return Components(**vars(parts), device=device,
                      timesteps=timesteps, plan=plan, caches=caches, encoder=encoder,
                      batches=batches, dist=dist)
