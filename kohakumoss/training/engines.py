"""Engines: what turns a built model into the one a run trains, applied from outside in one
fixed order (``docs/engines.md``):

1. precision: the weights are held in the policy's dtype (``cast_model``; a no-op for a
   model loaded in it, which ``build_components`` does);
2. kernels: the model gets its own op table from the kernel registry, chosen for the
   device and the dtype the forward computes in: static choices, else per shape bucket from
   the tuning table (``tuned``, made by ``tuned_kernels`` from ``kmoss tune_kernels``' table);
   with ``precision.base`` int8 / fp8 the block linears are then held quantized and run
   that table's ``quant_linear`` / ``fp8_linear`` (``hold_quantized``);
3. memory: recomputation wraps the elementwise ops of that table (so it wraps whichever
   backend step 2 chose), then activation checkpointing in the profile's mode wraps the
   repeated blocks or their halves (``kohakumoss.memory``; the profile is resolved by
   ``kohakumoss.training.autoprofile.resolve_profile``; with ``offload`` block or sub-block
   checkpointing keeps its inputs in host memory instead), then with ``rebuild`` the
   elementwise ops' outputs are left to be rebuilt in backward;
4. placement, once the trainable set is made (``apply_placement``): weight streaming moves
   the frozen block weights to host memory behind a ring of device slots, and the rest of
   the model and the trained tensors to the device (a streamed run loads the model on the
   host, so a base larger than the card never lands on it whole).

Each step only reads what the steps before it left. The engines run on the base model
before the trainable set is made: adapters take their dtype from the base weights step 1
set, and an adapter that wraps a linear inside a block is recomputed with the block.
Every engine here but a quantized base keeps outputs and gradients bit-identical
(``tests/test_engines.py``); a tuned kernel other than the reference keeps them within its
dtype's tolerance, and a quantized base is the model of its dequantized weights
(``tests/test_quantized.py``).

``tune_kernels`` (the ``kmoss tune_kernels`` stage) and ``tuned_kernels`` (train) wire the
params, the plan and the transformer's shape to the tuner (``kohakumoss.kernels.tuning``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from kohakumoss.artifacts import MANIFEST
from kohakumoss.config import Params, stage_params
from kohakumoss.configlib import ConfigError
from kohakumoss.kernels import KERNELS, build_op_table
from kohakumoss.kernels.problems import plan_calls, plan_problems
from kohakumoss.kernels.table import TABLE, describe, device_signature, read_table, winners
from kohakumoss.kernels.tuning import TuneResult, tune, tune_table
from kohakumoss.model.config import DiTConfig
from kohakumoss.diffusion.objective import OBJECTIVE
from kohakumoss.kernels.dispatch import REFERENCES
from kohakumoss.model.ops import OpTable
from kohakumoss.memory import apply_checkpointing, apply_recompute, repeated_blocks
from kohakumoss.memory.offload import apply_activation_offload
from kohakumoss.memory.rebuild import apply_rebuild
from kohakumoss.memory.profiles import MemoryEngines
from kohakumoss.memory.streaming import apply_weight_streaming
from kohakumoss.training.estimate import size
from kohakumoss.model.dit import HALVES, MOSSImageTransformer, cast_model
from kohakumoss.precision import PrecisionPolicy, precision_policy
from kohakumoss.precision.quant import QuantizedWeight
from kohakumoss.quant import quant_plan
from kohakumoss.quant.plan import DEFAULT_BACKENDS, of_policy
from kohakumoss.memory.host_copies import NodeCopies
from kohakumoss.quant.linear import keep_fp8_transposes, quantize_base
from kohakumoss.quant.ops import QUANT

QUANT_BACKENDS = tuple(DEFAULT_BACKENDS)  # the quantized base's ops (not tuned: quant/plan.py)


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    device: torch.device
    precision: PrecisionPolicy
    kernels: Mapping[str, str | Sequence[str]] = dataclasses.field(default_factory=dict)
    memory: MemoryEngines = MemoryEngines()  # recomputation and the checkpointing mode
    # "op/dtype/shape key" -> backends fastest first, for the ops without a static choice
    tuned: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class AppliedEngines:
    """What ``apply_engines`` did, in its order."""

    precision: dict[str, str]
    kernels: dict[str, str]  # op -> the implementation in the model's table
    recomputed: list[str]
    checkpointed: list[str]
    streaming: str = ""  # where the frozen weights live, when streamed (``apply_placement``)
    quantized: str = ""  # how the frozen base is held, when quantized (``precision.base``)
    # the objective's table (the loss: ``diffusion.objective.OBJECTIVE``), the plan's kernels
    objective: OpTable = dataclasses.field(default_factory=lambda: OpTable(OBJECTIVE))


def engine_plan(params: Params, device: torch.device,
                tuned: Mapping[str, Sequence[str]] | None = None,
                memory: MemoryEngines | None = None) -> EnginePlan:
    """The plan of a training run: precision from ``train.dtype`` and ``adapter.full``;
    the kernels of the tuning table's entries ``tuned`` (``tuned_kernels``; none: the
    references); the memory engines ``memory`` (``resolve_profile``'s; none: resolved
    without an estimate, ``speed``'s for ``auto``)."""
    if memory is None:
        from kohakumoss.training.autoprofile import resolve_profile

        memory = resolve_profile(params, None, device).engines
    from kohakumoss.precision.scaler import stream_scale

    compute = precision_policy(params.train.dtype, full=params.adapter.full).compute
    policy = precision_policy(params.train.dtype, full=params.adapter.full,
                              stream_scale=stream_scale(params.precision, compute),
                              **quant_plan(params.precision).policy_args())
    try:
        policy.check_device(device)
    except ValueError as e:
        raise ConfigError(f"{params.path}: {e}") from None
    return EnginePlan(device=device, precision=policy, tuned=dict(tuned or {}), memory=memory)


def apply_engines(model: MOSSImageTransformer, plan: EnginePlan,
                  stored: Callable[[str], QuantizedWeight | None] | None = None) -> AppliedEngines:
    """Apply precision, kernels and memory to ``model`` in that order (see the module);
    ``stored``: the checkpoint's quantized weights by name, for a quantized base."""
    cast_model(model, plan.precision.weights)
    if plan.precision.stream_scale != 1.0:
        model.set_stream_scale(plan.precision.stream_scale)
    model.ops = build_op_table(plan.device, plan.precision.compute, plan.kernels, plan.tuned)
    objective = build_op_table(plan.device, plan.precision.compute, plan.kernels, plan.tuned,
                               contract=OBJECTIVE)
    # after the table: the quantized linears run its ops
    quantized = hold_quantized(model, plan.precision, plan.device, stored, plan.kernels)
    if plan.memory.fp8_transposes and plan.precision.fp8_grad:
        keep_fp8_transposes(model)
    recomputed = apply_recompute(model) if plan.memory.recompute else []
    if plan.memory.offload:  # block or sub-block checkpointing with the kept inputs on the host
        halves = plan.memory.checkpointing == "sub-block"
        apply_activation_offload(model, plan.device, halves=halves)
        checkpointed = [f"{path}.{half}" if halves else path for path, _ in repeated_blocks(model)
                        for half in (HALVES if halves else ("",))]
    else:
        checkpointed = apply_checkpointing(model, plan.memory.checkpointing,
                                           plan.memory.checkpoint_blocks)
    if plan.memory.rebuild:  # what the blocks not checkpointed keep, less the elementwise outputs
        apply_rebuild(model)
    return AppliedEngines(plan.precision.describe(), model.ops.names(), recomputed, checkpointed,
                          quantized=quantized, objective=objective)


def hold_quantized(model: MOSSImageTransformer, policy: PrecisionPolicy, device: torch.device,
                   stored: Callable[[str], QuantizedWeight | None] | None = None,
                   chosen: Mapping[str, Any] | None = None) -> str:
    """With ``policy.base`` int8 / fp8: the block linears quantized on ``device``
    (``quantize_base``) over one table of the quantized ops (``quant.ops.QUANT``): ``chosen``'s
    backends where it names them, else the plan's (``QuantPlan.backends``); the model moved
    there. Returns the account ("" for keep)."""
    if policy.base == "keep":
        return ""
    ops = build_op_table(device, policy.compute, chosen, contract=QUANT)
    for op, backends in of_policy(policy).backends().items():
        if op not in (chosen or {}):  # no tuning: the kernel is the one that pays here
            ops.override(op, KERNELS.chosen_op(op, device, policy.compute, backends))
    quantized = quantize_base(model, policy.base, policy.fp8_compute, device, stored,
                              fp8_grad=policy.fp8_grad, ops=ops)
    model.to(device)
    log.info("frozen base: %s", quantized)
    return quantized


def apply_placement(model: MOSSImageTransformer, trainable, plan: EnginePlan,
                    applied: AppliedEngines, copies: NodeCopies | None = None) -> None:
    """The last engine, after the trainable set exists (an adapter is built beside the
    weight it wraps, so on the host when the model was loaded there): with
    ``memory.stream_slots`` the frozen block weights stream through that many device slots
    and the rest of the model and the trained tensors move to the device
    (``kohakumoss.memory.streaming``). A full finetune's block matrices stream too, held in
    the compute dtype: their fp32 masters are the host update's (``params.py`` requires
    ``memory.optimizer: host`` with it). ``copies``: the node's shared host copies of a
    frozen base (data-parallel ranks; ``memory.host_copies``)."""
    slots = plan.memory.stream_slots
    if not slots:
        return
    full = any(p.requires_grad for p in model.parameters())  # a full finetune's blocks stream too
    if full and plan.memory.resident_blocks:
        raise ValueError("resident blocks keep a frozen base's weights on the device; a full "
                         "finetune streams every block (resident_blocks 0)")
    ring = apply_weight_streaming(model, plan.device, slots, trainable=full,
                                  dtype=plan.precision.compute if full else None,
                                  resident=plan.memory.resident_blocks,
                                  copies=None if full else copies)
    trainable.to(plan.device)
    shared = ", one copy shared by the node's ranks" if isinstance(ring.copies, NodeCopies) else ""
    applied.streaming = (f"{len(ring.units)} blocks' weights ({size(ring.host_bytes())}) in "
                         f"{'pinned ' if ring.cuda else ''}host memory{shared}, streamed through "
                         f"{ring.n_slots} slots ({size(ring.resident_bytes())} on {plan.device})")
    log.info("weight streaming: %s", applied.streaming)


# -- kernel tuning: the tune_kernels stage and train's window ------------------------------------
log = logging.getLogger(__name__)

TUNE_PARAMS = ["model.transformer", "train.dtype", "train.device", "adapter.algo",
               "adapter.train_norms", "kernels.table", "kernels.tune_seconds", "kernels.backends"]


def plan_token_batches(plan: pa.Table) -> list[list[tuple[int, int]]]:
    """Each planned batch's samples as ``(image_tokens, text_tokens)``."""
    batch = plan.column("batch").to_pylist()
    pairs = zip(plan.column("image_tokens").to_pylist(), plan.column("text_tokens").to_pylist())
    out: dict[int, list[tuple[int, int]]] = {}
    for g, pair in zip(batch, pairs):
        out.setdefault(g, []).append(pair)
    return [out[g] for g in sorted(out)]


def _allow(params: Params) -> list[str] | None:
    """``kernels.backends`` (None: every backend); names registered for no op are reported."""
    names = params.kernels.backends
    if not names:
        return None
    KERNELS.load_experimental(names)  # an opt-in room (``kohakumoss.experimental``) by name
    known = {n for op in REFERENCES for n in KERNELS.names(op)}
    unknown = [n for n in names if n not in known]
    if unknown:
        log.warning("%s: kernels.backends names %s, which no op has here (backends: %s); ignored",
                    params.path, ", ".join(unknown), ", ".join(sorted(known)))
    return list(names)


def _weights_grad(params: Params) -> bool:
    """Whether the ops' parameters (norm weights, modulation) take gradients in this run:
    a full finetune, or trained norms; an adapter run's frozen base gives them none. The
    table's entries are not keyed by it: the run that first measures a shape decides."""
    return params.adapter.full or params.adapter.train_norms


def tune_kernels(params: Params, plan_dir: str | Path, out: str | Path
                 ) -> tuple[dict[str, Any], TuneResult, Any]:
    """``kmoss tune_kernels``: measure the backends on the plan's shapes for this device and
    the training dtype into ``out`` (kept entries are not measured again)."""
    from kohakumoss.checks.params import transformer_config
    from kohakumoss.data.planfile import read_plan
    from kohakumoss.device import resolve_device

    device = resolve_device(params.train.device)
    dtype = precision_policy(params.train.dtype, full=params.adapter.full).compute
    plan, manifest = read_plan(plan_dir)
    off = params.kernels.table == "off"
    config, batches = transformer_config(params), plan_token_batches(plan)
    problems = {} if off else plan_problems(config, batches)
    return tune_table(out, problems, device, dtype, budget_s=params.kernels.tune_seconds,
                      allow=_allow(params), weights_grad=_weights_grad(params),
                      calls=None if off else plan_calls(config, batches),
                      params=stage_params(params, TUNE_PARAMS), inputs={"plan": manifest})


def table_section(directory: str | Path | None, device: torch.device) -> dict[str, Any] | None:
    """The section of the tuning table in ``directory`` measured on this device with this
    software and these kernel sources, or None, saying plainly why not (no table, another
    device...). A changed table is an ``IntegrityError``."""
    signature = device_signature(device)
    if directory is None or not any((Path(directory) / f).is_file() for f in (TABLE, MANIFEST)):
        log.warning("no kernel tuning table in %s (run `kmoss tune_kernels`, or `dvc repro`)",
                    directory)
        return None
    table = read_table(directory)  # bytes that do not match the manifest: IntegrityError
    section = table.section(signature)
    if section is None:
        log.warning("the kernel tuning table %s is not used: %s", Path(directory) / TABLE,
                    table.why_not(signature))
    else:
        log.info("kernel tuning table %s: %d entries measured on this device (%s)",
                 Path(directory) / TABLE, len(section["entries"]), describe(signature))
    return section


def sampling_ops(params: Params, device: torch.device, dtype: torch.dtype,
                 directory: str | Path | None) -> OpTable:
    """The op table a sampler's model computes with (``kmoss sample``, ``kmoss grid``): the
    tuning table's choices for this device (its sizes follow the nearest training shape,
    ``TunedOp``), nothing measured now; the references when ``kernels.table`` is off or no
    table matches (said why)."""
    if params.kernels.table == "off":
        return build_op_table(device, dtype)
    return build_op_table(device, dtype, tuned=winners(table_section(directory, device)))


def tuned_kernels(params: Params, plan: EnginePlan, directory: str | Path | None,
                  config: DiTConfig, batches: list[list[tuple[int, int]]]) -> dict[str, list[str]]:
    """The tuning table's choices for this device (``EnginePlan.tuned``): the table in
    ``directory`` when its signature matches (else why not, plainly), plus the shapes it
    lacks, measured now within ``kernels.retune_seconds`` (not saved). A changed table is an
    ``IntegrityError``."""
    k = params.kernels
    if k.table == "off":
        log.info("kernels.table is off: every op runs its reference kernel")
        return {}
    section = table_section(directory, plan.device)
    problems = plan_problems(config, batches)
    dtype = plan.precision.compute
    have = section["entries"] if section else {}
    result = tune(problems, plan.device, dtype, budget_s=k.retune_seconds, allow=_allow(params),
                  have=have, weights_grad=_weights_grad(params), calls=plan_calls(config, batches))
    if result.entries or result.untuned:
        log.warning("measured %d kernel shape(s) the table lacks in %.1f s (kernels.retune_seconds"
                    " = %g; not saved: `kmoss tune_kernels` keeps them)%s", len(result.entries),
                    result.seconds, k.retune_seconds,
                    f"; {len(result.untuned)} unmeasured, each following its nearest measured shape"
                    if result.untuned else "")
    return {**winners(section), **winners({"entries": result.entries})}
