"""Optimiser side of training: parameter groups, the optimisers, the LR schedule, clipping.

* ``param_groups`` applies the weight-decay rule (``docs/adapters.md#optimizer-groups``) and
  per-parameter LR multipliers (LoRA+), merged by ``(lr, weight_decay)`` into few groups.
* ``build_optimizer``: the ``optim.name`` of ``training.optimizers.OPTIMIZERS`` from its
  library: ``adamw`` is one ``torch.optim.AdamW``; ``muon`` is ``torch.optim.Muon`` on the
  2-D weights of the repeated blocks plus AdamW on the rest, joined in a
  ``CombinedOptimizer`` that schedulers and checkpoints treat as one optimiser; torchao's
  8-bit AdamW (its states saved as plain codes and scales), Prodigy, schedule-free AdamW
  and torch's Adafactor over the same groups.
* ``lr_lambda`` / ``build_scheduler``: linear warmup then constant / cosine / linear decay.
* ``clip_and_check``: the fp32 total gradient norm, clipping, and whether it is finite.

fp32 master weights, gradient accumulation and skipping a non-finite step are the
trainer's job; this module only builds and steps the optimiser.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from kohakumoss.config import OptimConfig
from kohakumoss.model.dit import REPEATED
from kohakumoss.optimizers import NO_DECAY_NAMES, is_block_matrix_shape, optimizer_kind

log = logging.getLogger(__name__)

NamedParams = Sequence[tuple[str, nn.Parameter]]



def decays(name: str, param: torch.Tensor, rule: str) -> bool:
    """Whether ``param`` gets weight decay under ``rule`` (``moss`` | ``none`` | ``all``)."""
    if rule == "none":
        return False
    if rule == "all":
        return True
    if rule == "moss":
        return param.ndim > 1 and not any(key in name for key in NO_DECAY_NAMES)
    raise ValueError(f"unknown decay_rule {rule!r}; one of moss, none, all")


def param_groups(named_params: NamedParams, cfg: OptimConfig,
                 lr_scale: dict[str, float] | None = None, *,
                 lr: float | None = None) -> list[dict[str, Any]]:
    """Optimiser groups ``{"params", "param_names", "lr", "weight_decay"}``.

    A parameter's lr is ``lr`` (default ``cfg.lr``) times ``lr_scale.get(name, 1.0)``; its
    weight decay is ``cfg.weight_decay`` where the decay rule says so, else 0. Parameters
    with the same (lr, weight_decay) share a group; groups keep first-appearance order and
    parameters keep their given order. Frozen parameters (``requires_grad=False``) are left
    out. A name in ``lr_scale`` that is not a trainable parameter is an error (a LoRA+ map
    built against the wrong names would otherwise silently do nothing).
    """
    base_lr = cfg.lr if lr is None else lr
    scale = dict(lr_scale or {})
    groups: dict[tuple[float, float], dict[str, Any]] = {}
    seen: set[str] = set()
    for name, p in named_params:
        if name in seen:
            raise ValueError(f"parameter name {name!r} appears twice in the list given to the "
                             f"optimiser; pass each parameter once")
        seen.add(name)
        if not p.requires_grad:
            continue
        group_lr = base_lr * float(scale.pop(name, 1.0))
        wd = cfg.weight_decay if decays(name, p, cfg.decay_rule) else 0.0
        g = groups.setdefault((group_lr, wd), {"params": [], "param_names": [], "lr": group_lr,
                                               "weight_decay": wd})
        g["params"].append(p)
        g["param_names"].append(name)
    _check_scale_names(scale, set())
    return list(groups.values())


def _check_scale_names(lr_scale: Mapping[str, float], names: set[str]) -> None:
    extra = sorted(set(lr_scale) - names)
    if extra:
        raise ValueError(f"lr_scale names {extra[:5]}{' ...' if len(extra) > 5 else ''} are not "
                         f"trainable parameters; build lr_scale from the same named parameters "
                         f"given to the optimiser")


def is_block_matrix(name: str, param: torch.Tensor, block_prefixes: Sequence[str]) -> bool:
    """Muon's share (``optimizers.is_block_matrix_shape``)."""
    return is_block_matrix_shape(name, tuple(param.shape), block_prefixes)


def _adamw(groups: list[dict[str, Any]], cfg: OptimConfig) -> torch.optim.AdamW:
    params = [p for g in groups for p in g["params"]]
    # fused kernels where every parameter is on one kind of device, CUDA or the CPU (the
    # host update's masters: ~5x the for-loop's speed there); otherwise torch's default,
    # which copes with parameters spread over several kinds
    kinds = {p.device.type for p in params}
    fused = bool(params) and len(kinds) == 1 and kinds <= {"cuda", "cpu"} and all(
        p.is_floating_point() for p in params)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, fused=True if fused else None)


def _adamw8bit(groups: list[dict[str, Any]], cfg: OptimConfig) -> Optimizer:
    return eight_bit_adamw()(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             weight_decay=cfg.weight_decay)


def _prodigy(groups: list[dict[str, Any]], cfg: OptimConfig) -> Optimizer:
    from prodigyopt import Prodigy

    return Prodigy(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                   weight_decay=cfg.weight_decay, d_coef=cfg.prodigy_d_coef,
                   safeguard_warmup=cfg.warmup_steps > 0)


def _schedulefree(groups: list[dict[str, Any]], cfg: OptimConfig) -> Optimizer:
    from schedulefree import AdamWScheduleFree

    opt = AdamWScheduleFree(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                            weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps)
    opt.train()  # the parameters hold the trained sequence; AveragedStepper evaluates the other
    return opt


def _adafactor(groups: list[dict[str, Any]], cfg: OptimConfig) -> Optimizer:
    return torch.optim.Adafactor(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)


BUILDERS: dict[str, Callable[[list[dict[str, Any]], OptimConfig], Optimizer]] = {
    "adamw": _adamw, "adamw8bit": _adamw8bit, "prodigy": _prodigy,
    "schedulefree": _schedulefree, "adafactor": _adafactor}
"""Each single-part optimiser of ``training.optimizers.OPTIMIZERS`` over ``param_groups``."""


def build_optimizer(named_params: NamedParams, cfg: OptimConfig,
                    lr_scale: dict[str, float] | None = None,
                    block_prefixes: Sequence[str] = REPEATED) -> Optimizer:
    """``cfg.name`` over every trainable parameter, following the decay rule and
    ``lr_scale``. ``muon``: Muon (lr ``cfg.muon_lr``, momentum ``cfg.muon_momentum``,
    ``cfg.muon_ns_steps`` Newton-Schulz steps, Nesterov, torch's default shape scaling) on
    the 2-D weights of the repeated blocks (names ``<prefix>.…`` for a prefix in
    ``block_prefixes``), AdamW on the rest, as one ``CombinedOptimizer``."""
    named = [(n, p) for n, p in named_params if p.requires_grad]
    if not named:
        raise ValueError("no trainable parameters to optimise; check the adapter targets or "
                         "that the model is not fully frozen")
    if cfg.name in BUILDERS:
        return BUILDERS[cfg.name](param_groups(named, cfg, lr_scale), cfg)
    if cfg.name != "muon":
        raise ValueError(f"unknown optimiser {cfg.name!r}; one of {', '.join([*BUILDERS, 'muon'])}")
    scale = dict(lr_scale or {})
    _check_scale_names(scale, {n for n, _ in named})  # each half below sees only its own
    matrices = [(n, p) for n, p in named if is_block_matrix(n, p, block_prefixes)]
    rest = [(n, p) for n, p in named if not is_block_matrix(n, p, block_prefixes)]
    parts: list[Optimizer] = []
    if matrices:
        groups = param_groups(matrices, cfg, {n: scale[n] for n, _ in matrices if n in scale},
                              lr=cfg.muon_lr)
        parts.append(torch.optim.Muon(groups, lr=cfg.muon_lr, weight_decay=cfg.weight_decay,
                                      momentum=cfg.muon_momentum, ns_steps=cfg.muon_ns_steps))
    else:
        log.warning("optim.name is muon but no 2-D parameter lies under %s; every parameter "
                    "trains with AdamW", ", ".join(block_prefixes))
    if rest:
        parts.append(_adamw(param_groups(rest, cfg, {n: scale[n] for n, _ in rest
                                                     if n in scale}), cfg))
    return CombinedOptimizer(parts)


CODES = ("codes", "scale", "qmap", "signed")  # an 8-bit state as saved: torchao's fields


@functools.cache
def eight_bit_adamw() -> type[Optimizer]:
    """torchao's ``AdamW8bit`` whose state dict holds each 8-bit moment as plain tensors
    (``{"codes", "scale", "qmap", "signed"}``: the uint8 codes, one fp32 scale per block,
    the code map) instead of a tensor subclass, so a checkpoint saves it without pickle and
    a resume rebuilds the same state bit for bit."""
    from torchao.optim import AdamW8bit
    from torchao.optim.subclass_8bit import OptimState8bit

    class PlainStateAdamW8bit(AdamW8bit):
        def state_dict(self) -> dict[str, Any]:
            sd = super().state_dict()
            sd["state"] = {i: {k: ({"codes": v.codes, "scale": v.scale, "qmap": v.qmap,
                                    "signed": bool(v.signed)} if isinstance(v, OptimState8bit) else v)
                               for k, v in st.items()} for i, st in sd["state"].items()}
            return sd

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            def back(v):
                if isinstance(v, dict) and tuple(v) == CODES:
                    return OptimState8bit(v["codes"], v["scale"], v["qmap"], v["signed"])
                return v

            state = {i: {k: back(v) for k, v in st.items()} for i, st in state_dict["state"].items()}
            super().load_state_dict({**state_dict, "state": state})

    return PlainStateAdamW8bit


class _MergedState(Mapping):
    """Read-only view of several optimisers' per-parameter state."""

    def __init__(self, optimizers: Sequence[Optimizer]):
        self.optimizers = optimizers

    def __getitem__(self, param: torch.Tensor) -> Any:
        for opt in self.optimizers:
            if param in opt.state:
                return opt.state[param]
        raise KeyError(param)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for opt in self.optimizers:
            yield from opt.state

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self.optimizers)


class CombinedOptimizer(Optimizer):
    """Several optimisers over disjoint parameters, stepped, zeroed and saved as one.

    ``param_groups`` is the concatenation of the parts' group dicts (the same objects), so
    an LR scheduler scales every part; ``state_dict`` is ``{"optimizers": [part, ...]}``.
    """

    def __init__(self, optimizers: Sequence[Optimizer]):
        if not optimizers:
            raise ValueError("CombinedOptimizer needs at least one optimiser")
        self.optimizers = list(optimizers)
        params = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]
        if len(params) != len(set(params)):
            raise ValueError("the combined optimisers share a parameter; give each parameter "
                             "to exactly one of them")
        super().__init__(params, defaults={})  # hooks and step patching of the base class
        self._link()

    def _link(self) -> None:
        self.param_groups = [g for opt in self.optimizers for g in opt.param_groups]
        self.state = _MergedState(self.optimizers)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        parts = state_dict.get("optimizers") if isinstance(state_dict, dict) else None
        if not isinstance(parts, list) or len(parts) != len(self.optimizers):
            have = "no 'optimizers' list" if not isinstance(parts, list) else f"{len(parts)} parts"
            raise ValueError(f"optimiser state has {have}, this CombinedOptimizer has "
                             f"{len(self.optimizers)}; resume with the same optim.name and "
                             f"trainable parameters")
        for opt, sd in zip(self.optimizers, parts):
            opt.load_state_dict(sd)
        self._link()  # loading replaces each part's group dicts

    def __repr__(self) -> str:
        inner = "\n".join("  " + repr(opt).replace("\n", "\n  ") for opt in self.optimizers)
        return f"{type(self).__name__}(\n{inner}\n)"


def lr_lambda(cfg: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """LR factor for ``LambdaLR``'s 0-based step ``s`` (one per optimiser step).

    Warmup: ``(s + 1) / warmup_steps`` for ``s < warmup_steps`` (the first step trains at
    ``1 / warmup``, never at 0). Then, with ``p = (s - warmup) / (total_steps - warmup)``
    clamped to [0, 1]: constant ``1``; linear ``1 - (1 - m) p``; cosine
    ``m + (1 - m)(1 + cos(pi p)) / 2`` with ``m = min_lr_ratio``, which reaches ``m`` at
    ``s = total_steps`` (just after the last step, so no step is spent at the floor when
    ``m = 0``) and stays there.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    warmup, kind, floor = cfg.warmup_steps, cfg.schedule, cfg.min_lr_ratio
    if optimizer_kind(cfg.name).warms_up_itself:  # the optimizer's own warmup; no schedule
        warmup, kind = 0, "constant"
    if kind not in ("constant", "cosine", "linear"):
        raise ValueError(f"unknown schedule {kind!r}; one of constant, cosine, linear")
    span = total_steps - warmup

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        p = min(1.0, (step - warmup) / span) if span > 0 else 1.0
        if kind == "linear":
            return 1.0 - (1.0 - floor) * p
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * p))

    return factor


def build_scheduler(optimizer: Optimizer, cfg: OptimConfig, total_steps: int) -> LambdaLR:
    """``LambdaLR`` with ``lr_lambda``; call ``scheduler.step()`` after each optimiser step."""
    return LambdaLR(optimizer, lr_lambda(cfg, total_steps))


@torch.no_grad()
def clip_and_check(params: Iterable[torch.Tensor], max_norm: float) -> tuple[float, bool]:
    """Total L2 norm of the gradients (computed in fp32) and whether it is finite.

    With ``max_norm > 0`` and a finite norm the gradients are scaled in place as
    ``torch.nn.utils.clip_grad_norm_`` does (``clip_grads_with_norm_``, the same second
    half, reusing the fp32 norm). A non-finite norm leaves the gradients untouched; the
    caller skips the step. Parameters without a gradient are ignored.
    """
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return 0.0, True
    if any(_sharded(p.grad) for p in with_grad):
        return _clip_sharded(with_grad, max_norm)
    device = with_grad[0].grad.device
    norms = [torch.linalg.vector_norm(p.grad, dtype=torch.float32).to(device) for p in with_grad]
    total = torch.linalg.vector_norm(torch.stack(norms))
    value = float(total)
    finite = math.isfinite(value)
    if finite and max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, total)
    return value, finite


def _sharded(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _clip_sharded(with_grad: list[torch.Tensor], max_norm: float) -> tuple[float, bool]:
    """``clip_and_check`` over FSDP2's sharded gradients: each rank's squares summed, one
    all-reduce, the same coefficient on every shard."""
    import torch.distributed as dist

    local = [p.grad.to_local() if _sharded(p.grad) else p.grad for p in with_grad]
    sq = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in local]).sum()
    if dist.get_backend() == "nccl" and sq.device.type == "cpu":  # host-offloaded shards
        sq = sq.cuda()
    dist.all_reduce(sq)
    total = float(sq.sqrt())
    finite = math.isfinite(total)
    if finite and max_norm > 0:
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for p in with_grad:
                p.grad.mul_(coef)
    return total, finite
