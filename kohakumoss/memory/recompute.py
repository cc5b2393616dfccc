"""Recomputation of the elementwise ops: forward keeps only each op's inputs, backward
recomputes its fp32 intermediates.

The elementwise references (``kohakumoss.model.ops``) upcast to fp32 and would otherwise
keep several fp32 copies of every activation for autograd: without this a 2 x 1 MP step of
the 5B model needs more than 133 GiB. ``apply_recompute(model)`` wraps those entries of that
model's own op table, whatever backend the kernel step put there; the model's modules and
every other model are left alone. Outputs and gradients are exactly those of plain autograd.

A kernel whose own autograd keeps only the op's inputs (a fused backward recomputes what it
needs: the Triton kernels) has nothing to gain from this and would only pay a second
forward. It says so with ``fn.keeps_inputs_only = True`` and is not wrapped; an op that
picks its kernel per call (a tuned op) answers per call with
``fn.keeps_inputs_only_for(*args)``, and the wrapper runs such calls directly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kohakumoss.model.dit import MOSSImageTransformer
from kohakumoss.model.engines import Handle
from kohakumoss.model.ops import FORMS

ENGINE = "recompute"

# op name -> how many leading arguments are tensors (saved for backward; the index tensor
# ``seg`` among them); the rest are static (``eps``)
ELEMENTWISE: dict[str, int] = {
    "rms_norm": 2,
    "modulated_rms_norm": 5,
    "qk_norm_rope": 4,
    "situ": 2,
    "residual": 2,
    "gated_residual": 4,
}


class _Recompute(torch.autograd.Function):
    """Run ``fn`` without saving its intermediates; recompute them in backward."""

    @staticmethod
    def forward(ctx, fn, static, *tensors):
        ctx.fn, ctx.static = fn, static
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            return fn(*tensors, *static)

    @staticmethod
    def backward(ctx, grad):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.fn(*inputs, *ctx.static)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True) if wanted else ())
        return (None, None, *[next(grads) if t.requires_grad else None for t in inputs])


def keeps_inputs_only(fn: Callable) -> bool:
    """Whether ``fn``'s own autograd keeps only its inputs, for every call."""
    return getattr(fn, "keeps_inputs_only", False) is True


def recomputed(fn: Callable, n_tensors: int) -> Callable:
    """``fn(*tensors, *static)`` with its first ``n_tensors`` arguments as autograd inputs;
    ``.wrapped`` is ``fn``. Without grad (inference), and for the calls ``fn`` says keep
    only their inputs anyway (``fn.keeps_inputs_only_for``), it is ``fn`` itself."""
    per_call = getattr(fn, "keeps_inputs_only_for", None)

    def op(*args):
        tensors, static = args[:n_tensors], args[n_tensors:]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors) \
                and not (per_call is not None and per_call(*args)):
            return _Recompute.apply(fn, static, *tensors)
        return fn(*args)

    op.__qualname__ = f"recomputed({getattr(fn, '__qualname__', repr(fn))})"
    op.wrapped = fn
    for form in FORMS:
        # a half's norm keeps its forms: ``stream`` (``ops.stream_norm``) runs only a kernel
        # that keeps its inputs alone, and without it autograd sums x's two gradients in a
        # pass of its own (a table choosing Triton with compile after it was wrapped so);
        # ``added`` (``ops.added_norm``) is inference only, where the wrap is ``fn`` itself
        if getattr(fn, form, None) is not None:
            setattr(op, form, getattr(fn, form))
    return op


def apply_recompute(model: MOSSImageTransformer) -> list[str]:
    """Wrap the elementwise ops of ``model.ops`` (its own table) in ``recomputed``, except
    those whose kernel keeps only its inputs anyway; returns the ops wrapped now (none when
    applied before: it is idempotent)."""
    done = []
    for name, n_tensors in ELEMENTWISE.items():
        fn = getattr(model.ops, name)
        if getattr(fn, "wrapped", None) is None and not keeps_inputs_only(fn):
            model.ops.override(name, recomputed(fn, n_tensors))
            done.append(name)
    if done and model.engines.get(ENGINE) is None:
        model.engines.register(Handle(ENGINE, state=done))
    return done
