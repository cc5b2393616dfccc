"""Recomputation of the elementwise ops: forward keeps only each op's inputs, backward
recomputes its fp32 intermediates.

The elementwise references (``kohakumoss.model.ops``) upcast to fp32 and would otherwise
keep several fp32 copies of every activation for autograd: without this a 2 x 1 MP step of
the 5B model needs more than 133 GiB. ``apply_recompute(model)`` wraps those entries of that
model's own op table, whatever backend the kernel step put there; the model's modules and
every other model are left alone. Outputs and gradients are exactly those of plain autograd.

A kernel whose own autograd keeps only the op's inputs (a fused backward recomputes what it
needs: the Triton kernels) has nothing to gain from this and would only pay a second
forward. Its table entry says so (``OpEntry.keeps`` True) and is not wrapped; an op that
picks its kernel per call (a tuned op) answers per call (``entry.keeps_inputs_only_for``),
and the wrapper runs such calls directly. The wrap is ``entry.wrap``: the entry's forms and
its per-call choice stay.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kohakumoss.model.dit import MOSSImageTransformer
from kohakumoss.model.engines import Handle
from kohakumoss.model.ops import OpEntry

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


def recomputed(fn: Callable | OpEntry, n_tensors: int) -> OpEntry:
    """``fn``'s entry wrapped: ``fn(*tensors, *static)`` with its first ``n_tensors``
    arguments as autograd inputs; ``.wraps`` is ``fn``'s entry. Without grad (inference), and
    for the calls the entry says keep only their inputs anyway, it runs ``fn`` itself. The
    norm's forms stay: ``stream`` (``ops.stream_norm``) runs only a kernel that keeps its
    inputs alone, and ``added`` (``ops.added_norm``) is inference only."""
    inner = OpEntry.of(fn)

    def op(*args):
        tensors, static = args[:n_tensors], args[n_tensors:]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors) \
                and not inner.keeps_inputs_only_for(*args):
            return _Recompute.apply(inner.fn, static, *tensors)
        return inner.fn(*args)

    return inner.wrap(op, ENGINE, label=f"recomputed({inner.label})")


def apply_recompute(model: MOSSImageTransformer) -> list[str]:
    """Wrap the elementwise ops of ``model.ops`` (its own table) in ``recomputed``, except
    those whose kernel keeps only its inputs anyway; returns the ops wrapped now (none when
    applied before: it is idempotent)."""
    done = []
    for name, n_tensors in ELEMENTWISE.items():
        fn = getattr(model.ops, name)
        if not fn.wrapped_by(ENGINE) and not fn.keeps_inputs_only:
            model.ops.override(name, recomputed(fn, n_tensors))
            done.append(name)
    if done and model.engines.get(ENGINE) is None:
        model.engines.register(Handle(ENGINE, state=done))
    return done
