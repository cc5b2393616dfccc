"""Linears that read one input (a joint block's q, k and v) run as one LoRA node when each
carries a folding LoRA (``folded.lora_linears``; on fp8 compute bases
``folded.fp8_lora_linears``); otherwise one by one, as the model's own
``ops.linears`` does.

``apply_adapters`` puts a ``SharedInputLinears`` over the set's own table (``AdapterSet.ops``:
its narrow products) in the model's op table (``linears``). Per
call it checks each linear as ``runtime._run`` would route it: LyCORIS's forward installed
by this package, the fold's conditions (``runtime.folds``: a LoRA or LoCon in bypass mode,
no DoRA, Tucker core, trained scalar or drawing dropout), a plain ``nn.Linear`` base
without bias, a multiplier other than 0, not skipped this step. Each module's forward
pre-hooks run first, as a call of the module would run them (a weight ring's loads); a
pre-hook that changes the input, or any other hook, sends the group through the modules
themselves, so the result never depends on the route beyond the order of fp32 sums.

What one node saves over three: the input is read once for the three down products and
once for their gradient, and the input gradient is one tensor (``t A`` with each
``dy W`` accumulated in place) instead of three added by autograd.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn.modules import module as _module

from kohakumoss.adapters.casts import lora_factors
from kohakumoss.adapters.folded import (fp8_fold_parts, fp8_lora_linears,
                                        folded_forward, linear_dtype, lora_linears)
from kohakumoss.adapters.runtime import _needs_own_dtype, _run, folds
from kohakumoss.model.ops import linear as ref_linear
from kohakumoss.model.ops import linears as ops_linears


def hooked(m: nn.Module) -> bool:
    """Hooks other than plain forward pre-hooks, which a call of module ``m`` would run (a
    user's, or torch's global ones): the group then takes the modules' own route."""
    return bool(m._forward_hooks or m._forward_pre_hooks_with_kwargs or m._backward_hooks
                or m._backward_pre_hooks or _module._global_forward_hooks
                or _module._global_forward_pre_hooks or _module._global_backward_hooks
                or _module._global_backward_pre_hooks)


def _pre_hooked(m: nn.Module, x: torch.Tensor) -> tuple:
    """``m``'s forward pre-hooks run on ``(x,)`` as its call would: the arguments after them."""
    args = (x,)
    for hook in m._forward_pre_hooks.values():
        out = hook(m, args)
        if out is not None:
            args = out if isinstance(out, tuple) else (out,)
    return args


def _folding(m: nn.Module):
    """The LyCORIS module whose folding forward ``m`` runs now (``runtime.folds``), else None."""
    fwd = m.__dict__.get("forward")
    if not (isinstance(fwd, functools.partial) and fwd.func is _run):
        return None
    lyco = fwd.args[0]
    if lyco.multiplier == 0 or (lyco.training and lyco.kmoss_skip) or not folds(lyco):
        return None
    return lyco


def fold_parts(m: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None:
    """``(weight, down, alpha * up, 1.0)``, the factors in ``dtype`` (the linears' compute
    dtype; ``casts.lora_factors``), when ``m``'s forward now is a folding LoRA on a plain
    bias-free linear, else None."""
    lyco = _folding(m)
    if lyco is None:
        return None
    if getattr(lyco.org_forward, "__func__", None) is not nn.Linear.forward or m.bias is not None:
        return None
    return m.weight, *lora_factors(lyco, dtype), 1.0


def _fp8_parts(m: nn.Module, dtype: torch.dtype) -> tuple | None:
    """``folded.fp8_fold_parts`` of ``m``'s folding LoRA (cast to ``dtype``), when its
    forward now is one."""
    lyco = _folding(m)
    return None if lyco is None else fp8_fold_parts(lyco, dtype)


class SharedInputLinears:
    """The model's ``ops.linears`` while an adapter set is on it: ``shared_input_linears``
    with the narrow products of the set's table (``ops``: ``adapters.ops.ADAPTER_OPS``)."""

    def __init__(self, ops):
        self.ops = ops
        self.__qualname__ = "shared_input_linears"

    def __call__(self, x: torch.Tensor, modules, linear=None, plain=lambda m: False) -> list[torch.Tensor]:
        return shared_input_linears(x, modules, linear, self.ops.narrow_mm, plain)


def shared_input_linears(x: torch.Tensor, modules, linear=None, narrow=None,
                         plain=lambda m: False) -> list[torch.Tensor]:
    """``[m(x) for m in modules]``, as one node where every module folds (see the module),
    the base products through ``linear`` (the model's ``ops.linear``), the narrow ones
    (``x A^T``, ``dy B``) through ``narrow`` (an adapter set's ``ops.narrow_mm``). Each module's forward
    pre-hooks run first, as its call would run them (a weight ring's loads); one that
    changes the input, or any other hook, takes the modules' own route. A lone folding
    module is its own node (``folded_forward``) with its base product through ``linear``;
    a plain linear (``plain``: the model's ``engines.plain_linear``) goes to ``linear`` itself."""
    if any(hooked(m) for m in modules):
        return [m(x) for m in modules]
    if len(modules) < 2:
        lyco = _folding(modules[0])
        if lyco is not None and not modules[0]._forward_pre_hooks and not (
                x.dtype != lyco.dtype_tensor.dtype and _needs_own_dtype(lyco)):  # as _run routes
            return [folded_forward(lyco, x, linear, narrow)]
        return [ops_linears(x, modules, linear or ref_linear, plain=plain)[0]]
    args = [_pre_hooked(m, x) for m in modules]
    if not all(len(a) == 1 and a[0] is x for a in args):
        return [m.forward(*a) for m, a in zip(modules, args)]
    dt = linear_dtype(x)
    parts = [fold_parts(m, dt) for m in modules]  # cast as lora_linears computes
    if all(p is not None for p in parts):
        return lora_linears(x, parts, linear, narrow)
    fp8 = [_fp8_parts(m, x.dtype) for m in modules]  # fp8 compute bases (precision.fp8_compute)
    if all(p is not None for p in fp8) and \
            len({p[0].codes.shape[0] for p in fp8}) == 1 and len({p[0].fp8_grad for p in fp8}) == 1:
        return fp8_lora_linears(x, fp8, narrow)
    return [m.forward(*a) for m, a in zip(modules, args)]
