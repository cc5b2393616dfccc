"""What every custom-op kernel module shares, Triton or TileLang, with no compiler imported:
how an op's kernels are entered (``entry``: the custom op under ``torch.compile``, a plain
``autograd.Function`` in eager mode), and the 2-D views the kernels take.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode


def entry(op, impl: Callable, setup: Callable, backward: Callable, bwd_op=None,
          bwd_impl: Callable | None = None) -> Callable:
    """How an op's kernels are called: ``op`` (a ``torch.library`` custom op over ``impl``)
    under ``torch.compile``, which sees through it, and under a dispatch mode, which then sees
    the kernel as one op (activation offload's replay records and hands back an attention
    kernel's outputs so: ``memory/replay.py``); in eager mode otherwise ``impl`` itself, through
    a plain ``autograd.Function`` when an input needs a gradient (no autograd at all when none
    does): the dispatcher's per-call cost adds up at a dozen calls per block. Both run the
    same ``setup`` and ``backward``; ``ctx.bwd`` is the backward kernel's custom op or its
    ``impl`` accordingly."""

    def setup_op(ctx, inputs, output):
        setup(ctx, inputs, output)
        ctx.bwd = bwd_op

    op.register_autograd(backward, setup_context=setup_op)

    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            out = impl(*inputs)
            setup(ctx, inputs, out)
            ctx.bwd = bwd_impl
            return out

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

    def call(*args):
        if torch.compiler.is_compiling() or is_in_torch_dispatch_mode():
            return op(*args)
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                           for a in args):
            return Eager.apply(*args)
        return impl(*args)

    return call


def like(t: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    """An empty tensor on ``t``'s device: ``t``'s shape and dtype unless given (outputs, and
    the fake registrations' results)."""
    return torch.empty(t.shape if shape is None else shape, dtype=dtype or t.dtype, device=t.device)


def rows2d(t: torch.Tensor, cols: int) -> torch.Tensor:
    """``t`` as [R, cols] with unit column stride (a view when possible)."""
    t2 = t.reshape(-1, cols)
    return t2 if t2.stride(-1) == 1 or t2.shape[0] == 0 else t2.contiguous()


def packed_halves(u: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``ug`` whose column halves ``u`` and ``g`` are (``ug.split(C, -1)``, up
    first), when it is row-contiguous; else None."""
    base = u._base
    if base is None or g._base is not base or u.dim() == 0 or not base.is_contiguous():
        return None
    C = u.shape[-1]
    if base.shape != (*u.shape[:-1], 2 * C) or u.stride() != base.stride() \
            or g.stride() != base.stride():
        return None
    if (u.requires_grad or g.requires_grad) and not base.requires_grad:
        return None  # a view made a leaf of its own: its gradient is not the base's
    start = base.storage_offset()
    return base if u.storage_offset() == start and g.storage_offset() == start + C else None


def gated_residual_setup(ctx, inputs, output):
    """What the backward of ``x + gate[seg] y`` keeps: the gate, the samples, x's dtype, and y
    only where the gate takes a gradient (its per-sample sums read y; nothing else does). An
    adapter run's frozen modulation so keeps no branch output: two [tokens, width] tensors a
    block, 8.6 GB at 16,800 tokens (the references keep none either)."""
    x, y, gate, seg = inputs
    ctx.save_for_backward(y if gate.requires_grad else None, gate, seg)
    ctx.x_dtype, ctx.y_dtype = x.dtype, y.dtype
