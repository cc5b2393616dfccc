"""Engines: what turns a built model into the one a run trains, applied from outside in one
fixed order (``docs/engines.md``):

1. precision: the weights are held in the policy's dtype (``cast_model``; a no-op for a
   model loaded in it, which ``build_components`` does);
2. kernels: the model gets its own op table from the kernel registry, chosen for the
   device and the dtype the forward computes in;
3. memory: recomputation wraps the elementwise ops of that table (so it wraps whichever
   backend step 2 chose), then per-block activation checkpointing wraps the repeated blocks.

Each step only reads what the steps before it left. The engines run on the base model
before the trainable set is made: adapters take their dtype from the base weights step 1
set, and an adapter that wraps a linear inside a block is recomputed with the block.
Every engine here keeps outputs and gradients bit-identical (``tests/test_engines.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from kohakumoss.config import Params
from kohakumoss.kernels import build_op_table
from kohakumoss.memory import apply_block_checkpointing, apply_recompute
from kohakumoss.model.dit import MOSSImageTransformer, cast_model
from kohakumoss.precision import PrecisionPolicy, precision_policy


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    device: torch.device
    precision: PrecisionPolicy
    kernels: Mapping[str, str | Sequence[str]] = dataclasses.field(default_factory=dict)
    recompute: bool = True  # recompute the elementwise ops' fp32 intermediates in backward
    checkpoint_every: int = 0  # checkpoint every n-th repeated block; 0: none


@dataclasses.dataclass
class AppliedEngines:
    """What ``apply_engines`` did, in its order."""

    precision: dict[str, str]
    kernels: dict[str, str]  # op -> the implementation in the model's table
    recomputed: list[str]
    checkpointed: list[str]


def engine_plan(params: Params, device: torch.device) -> EnginePlan:
    """The plan of a training run: precision from ``train.dtype`` and ``adapter.full``;
    reference kernels (no backend is chosen in params.yaml yet); recomputation on, as every
    run so far trained with it; no block checkpointing (no knob for it yet)."""
    return EnginePlan(device=device, precision=precision_policy(params.train.dtype,
                                                                full=params.adapter.full))


def apply_engines(model: MOSSImageTransformer, plan: EnginePlan) -> AppliedEngines:
    """Apply precision, kernels and memory to ``model`` in that order (see the module)."""
    cast_model(model, plan.precision.weights)
    model.ops = build_op_table(plan.device, plan.precision.compute, plan.kernels)
    recomputed = apply_recompute(model) if plan.recompute else []
    checkpointed = (apply_block_checkpointing(model, plan.checkpoint_every)
                    if plan.checkpoint_every else [])
    return AppliedEngines(plan.precision.describe(), model.ops.names(), recomputed, checkpointed)
