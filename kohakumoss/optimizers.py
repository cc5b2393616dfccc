"""The optimizers ``optim.name`` can pick (``docs/training.md#optimizers``): what each one is,
the library that implements it, where it cannot run and why, and the bytes of its state.

This module imports no optimizer library: ``params`` checks a run against it when the file
loads, the memory estimator counts states with it, and ``optim.build_optimizer`` builds the
named one (its library imported then).

- ``adamw``: ``torch.optim.AdamW`` (fused where every tensor is on one kind of device).
- ``muon``: ``torch.optim.Muon`` on the joint blocks' matrices, AdamW on the rest.
- ``adamw8bit``: torchao's ``AdamW8bit``: both moments as 8-bit codes with one fp32 scale per
  256 values (tensors of 4,096 values or more whose size 256 divides; smaller ones fp32).
- ``prodigy``: ``prodigyopt.Prodigy``, which estimates the step size itself: ``optim.lr`` is a
  multiplier of its estimate (1.0 is the library's default).
- ``schedulefree``: ``schedulefree.AdamWScheduleFree``: no decay schedule; it trains one
  sequence of weights and evaluates, saves and exports another (an average of the first),
  so previews, validation and checkpoints see the averaged weights.
- ``adafactor``: ``torch.optim.Adafactor``: a matrix's second moment as one row and one
  column factor (nearly no state), ``optim.lr`` a cap on the relative step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

FP32 = 4

# the ``moss`` rule: parameters whose name holds one of these never decay (nor do 1-D ones)
NO_DECAY_NAMES = ("dora_scale", "rescale", "scalar", "lambda_layer", "alpha")


def is_block_matrix_shape(name: str, shape: Sequence[int], block_prefixes: Sequence[str]) -> bool:
    """Muon's share: a 2-D weight (both sides > 1) inside a repeated block (a name under one
    of ``block_prefixes``), not a decay-exempt name (a DoRA ``dora_scale`` is [out, 1]-shaped
    and must not be orthogonalised)."""
    in_block = any(name.startswith(prefix + ".") for prefix in block_prefixes)
    return (in_block and len(shape) == 2 and min(shape) > 1
            and not any(key in name for key in NO_DECAY_NAMES))


def _moments(n: int, count: int = 2) -> int:
    return count * n * FP32


def _adamw_state(name: str, shape: Sequence[int]) -> int:
    return _moments(math.prod(shape)) + FP32  # two moments and the step count (a 0-d tensor)


def _adamw8bit_state(name: str, shape: Sequence[int], block: int = 256) -> int:
    n = math.prod(shape)
    if n >= 4096 and n % block == 0:  # torchao quantizes these (as bitsandbytes does)
        one = n + (n // block) * FP32 + 256 * FP32  # codes, the blocks' scales, the code map
        return 2 * one + FP32
    return _adamw_state(name, shape)


def _prodigy_state(name: str, shape: Sequence[int]) -> int:
    return _moments(math.prod(shape), 4)  # the two moments, s and the initial weights p0


def _schedulefree_state(name: str, shape: Sequence[int]) -> int:
    return _moments(math.prod(shape))  # z and the second moment


def _adafactor_state(name: str, shape: Sequence[int]) -> int:
    if len(shape) >= 2:  # one row and one column factor per matrix (of the last two dims)
        lead = math.prod(shape[:-2])
        return (lead * shape[-2] + lead * shape[-1]) * FP32 + FP32
    return math.prod(shape) * FP32 + FP32


@dataclasses.dataclass(frozen=True)
class OptimizerKind:
    """One ``optim.name``: its library, what it refuses and why, and its state's size."""

    name: str
    library: str  # the pip package that implements it
    state: Callable[[str, Sequence[int]], int]  # bytes of state for one fp32 trained tensor
    refuses: Mapping[str, str] = dataclasses.field(default_factory=dict)  # what -> why
    warms_up_itself: bool = False  # optim.warmup_steps goes to the optimizer, not the schedule
    averages: bool = False  # evaluates and saves averaged weights (``steppers.AveragedStepper``)


_PER_TENSOR = "steps each tensor on its own"
_SHARDED = ("a full finetune over ranks (FSDP2) holds 1/world of each tensor on a rank")

OPTIMIZERS: dict[str, OptimizerKind] = {k.name: k for k in (
    OptimizerKind("adamw", "torch", _adamw_state),
    OptimizerKind("muon", "torch", _adamw_state, refuses={
        "fsdp": f"Muon's Newton-Schulz step needs whole matrices and {_SHARDED}"}),
    OptimizerKind("adamw8bit", "torchao", _adamw8bit_state, refuses={
        "streamed": "its 8-bit states are torchao tensor subclasses, which the streamed "
                    "states' page-locked host buffers do not hold",
        "host": "what it saves is device memory, and the host update keeps the states in host "
                "memory already; there torchao compiles its step into C++ per tensor shape "
                "(use optim.name: adamw, whose fused CPU step the host update runs)",
        "fsdp": f"{_SHARDED}, and the 8-bit blocks of a shard's states are not saved or "
                f"resumed as a whole tensor's"}),
    OptimizerKind("prodigy", "prodigyopt", _prodigy_state, refuses={
        "fused": "its step size is one estimate over every trained tensor's gradient, which "
                 "the step in backward does not have when it updates the first tensor",
        "streamed": "its step size is one estimate over every trained tensor, and the "
                    "streamed states step the tensors in groups, one call each",
        "host": "its step size is one estimate over every trained tensor, and the host "
                "update steps them in chunks, one per block, beside the next forward",
        "fsdp": f"{_SHARDED}, and each rank would estimate its own step size",
        "zero_lr": "its learning rate multiplies its own step-size estimate and must be > 0 "
                   "(1.0 is its default)"}),
    OptimizerKind("schedulefree", "schedulefree", _schedulefree_state, refuses={
        "fused": "its weight average advances once a step over every tensor, not once per "
                 "tensor as the step in backward calls it",
        "streamed": "its weight average advances once a step over every tensor, not once per "
                    "group of tensors as the streamed states call it",
        "host": "it trains one sequence of weights and evaluates another, and the host "
                "update's masters hold only the trained one",
        "fsdp": f"{_SHARDED}; its averaged weights are not gathered",
        "ema": "it averages the weights itself (set optim.ema: 0)",
        "schedule": "it replaces the decay schedule (set optim.schedule: constant; "
                    "optim.warmup_steps is its own warmup)"},
        warms_up_itself=True, averages=True),
    OptimizerKind("adafactor", "torch", _adafactor_state, refuses={
        "fsdp": f"{_SHARDED}, and a shard's row and column factors are not the whole "
                f"matrix's"}),
)}


def optimizer_kind(name: str) -> OptimizerKind:
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; one of {', '.join(OPTIMIZERS)}") from None


def refusal(name: str, what: str) -> str | None:
    """Why optimizer ``name`` cannot run with ``what`` (a placement of ``memory.optimizer``,
    ``fsdp``, ``ema``, ``schedule`` or ``zero_lr``), or None where it can."""
    return optimizer_kind(name).refuses.get(what)


def state_bytes(name: str, tensors: Sequence[tuple[str, Sequence[int]]],
                block_prefixes: Sequence[str] = ()) -> int:
    """The bytes of optimizer ``name``'s state over ``tensors`` (each trained tensor's name
    and shape, fp32), every tensor of it counted: what ``optimizer.state_dict()`` holds
    after a step. Muon keeps one momentum for the joint blocks' matrices (names under
    ``block_prefixes``), AdamW's two moments for the rest."""
    kind = optimizer_kind(name)
    if name != "muon":
        return sum(kind.state(n, s) for n, s in tensors)
    return sum(_moments(math.prod(s), 1) if is_block_matrix_shape(n, s, block_prefixes)
               else _adamw_state(n, s) for n, s in tensors)
