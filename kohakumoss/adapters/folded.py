"""A LoRA delta folded into its base matmul (``folded_forward``, for the modules
``runtime.folds`` picks); on a plain linear, the layer as one autograd node:
``x W^T + b + (x A^T) (alpha B)^T`` (``lora_linear``).

Autograd over the separate ops (base linear, ``x A^T``, an ``addmm`` onto the base output)
costs a full-width tensor twice per adapted linear: the forward's ``addmm`` copies the
base output before it accumulates into it, and the backward adds the base path's input
gradient to the LoRA path's. Here both sums happen inside a matmul (beta = 1):

- forward: ``h = x A^T`` ([tokens, r]), ``y = h (alpha B)^T (+ b)`` (a narrow product that
  writes the output once), then ``y += x W^T`` in place: the base matmul accumulates onto
  it, reading it in its epilogue;
- backward: ``t = dy (alpha B)`` ([tokens, r]), ``dA = t^T x``, ``d(alpha B) = dy^T h``,
  and ``dx = t A`` with ``dy W`` accumulated onto it in place.

Under a dispatch mode (selective checkpointing's, which caches op outputs as its mode sees
them, before an in-place op bumps their version) the base matmul accumulates out of place
(one copy); selective keeps its output and recomputes the narrow product. Saved for
backward: the input, ``h`` and the weights, as the separate ops save them (the memory
engines' hooks see the same tensors). The base weight and bias get gradients only where
they need them (a frozen base: never). The math is the separate ops' up to the order of
the sums and ``alpha`` applied to ``B`` before its cast (``tests/test_adapters.py``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from kohakumoss.adapters.casts import lora_factors
from kohakumoss.model.ops import linear as ref_linear
from kohakumoss.adapters.ops import narrow_mm as ref_narrow_mm
from kohakumoss.quant.ops import slot_width


class _LoraLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, down, up, evaluate=True, linear=None, narrow=None):
        ctx.narrow = narrow = narrow or ref_narrow_mm
        h = narrow(x2, down.t())
        ctx.save_for_backward(x2, h, weight, down, up)
        ctx.linear = linear or ref_linear
        if not evaluate:  # nobody reads the output (memory.replay.unevaluated): backward only
            return x2.new_zeros(x2.shape[0], weight.shape[0])
        y = torch.mm(h, up.t()) if bias is None else torch.addmm(bias, h, up.t())
        # the base product accumulates onto y (out of place under a dispatch mode: selective
        # checkpointing caches outputs as its mode sees them, in-place ones look mutated)
        return ctx.linear(x2, weight, y)

    @staticmethod
    def backward(ctx, dy):
        x2, h, weight, down, up = ctx.saved_tensors
        need_x, need_w, need_b, need_down, need_up = ctx.needs_input_grad[:5]
        t = ctx.narrow(dy, up)
        dx = ctx.linear(dy, weight.t(), torch.mm(t, down)) if need_x else None
        return (dx, torch.mm(dy.t(), x2) if need_w else None, dy.sum(0) if need_b else None,
                torch.mm(t.t(), x2) if need_down else None, torch.mm(dy.t(), h) if need_up else None,
                None, None, None)


def _compute_dtype(x: torch.Tensor) -> tuple[str, bool, torch.dtype]:
    """(device type, autocast available there, the dtype a linear computes in: autocast's
    where it is on, else ``x``'s). Not available on the estimator's meta device."""
    dev = x.device.type
    autocast = torch.amp.is_autocast_available(dev)
    return dev, autocast, torch.get_autocast_dtype(dev) if autocast and torch.is_autocast_enabled(dev) else x.dtype


def linear_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear on ``x`` computes in (autocast's where it is on, else ``x``'s)."""
    return _compute_dtype(x)[2]


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                down: torch.Tensor, up: torch.Tensor, alpha: float, evaluate: bool = True,
                linear=None, narrow=None) -> torch.Tensor:
    """``F.linear(x, weight, bias) + alpha * F.linear(F.linear(x, down), up)`` in the
    dtype the linear computes in (autocast's where it is on, else ``x``'s); ``down`` [r, in]
    and ``up`` [out, r] may be held in another dtype (their gradients come back in it).
    ``evaluate=False``: zeros out, the same gradients back (an output nobody reads).
    ``linear``: the base products' op (a table's ``ops.linear``; None: the reference);
    ``narrow``: the narrow ones' (``x A^T``, ``dy B``; an adapter set's ``ops.narrow_mm``)."""
    dev, autocast, dt = _compute_dtype(x)
    up = up * alpha if alpha != 1.0 else up
    x_c, w_c, b_c, down_c, up_c = (t if t is None or t.dtype == dt else t.to(dt)
                                   for t in (x, weight, bias, down, up))
    with torch.autocast(dev, enabled=False) if autocast else contextlib.nullcontext():
        y = _LoraLinear.apply(x_c.reshape(-1, x.shape[-1]), w_c, b_c, down_c, up_c, evaluate, linear,
                              narrow)
    return y.view(*x.shape[:-1], weight.shape[0])


class _LoraLinears(torch.autograd.Function):
    """``lora_linear`` for several bias-free linears on one input, as one node: one narrow
    product ``x A^T`` for all their down matrices (stacked), and one input gradient."""

    @staticmethod
    def forward(ctx, x2, ranks, linear, narrow, down, *tensors):
        n = len(ranks)
        weights, ups = tensors[:n], tensors[n:]
        ctx.narrow = narrow = narrow or ref_narrow_mm
        h = narrow(x2, down.t())  # [tokens, sum of ranks]: x read once for every down
        ctx.linear = linear = linear or ref_linear
        outs = [linear(x2, w, torch.mm(hi, up.t()))  # the base product onto the narrow one
                for w, up, hi in zip(weights, ups, h.split(ranks, dim=1))]
        ctx.ranks = ranks
        ctx.save_for_backward(x2, h, down, *weights, *ups)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *dys):
        x2, h, down, *rest = ctx.saved_tensors
        n = len(ctx.ranks)
        weights, ups = rest[:n], rest[n:]
        need_x, _, _, _, need_down = ctx.needs_input_grad[:5]
        need_w, need_up = ctx.needs_input_grad[5:5 + n], ctx.needs_input_grad[5 + n:]
        # t = dy (alpha B) per linear, side by side; an unused output contributes nothing
        t = torch.cat([ctx.narrow(dy, up) if dy is not None else x2.new_zeros(x2.shape[0], r)
                       for dy, up, r in zip(dys, ups, ctx.ranks)], dim=1)
        dx = None
        if need_x:  # dx = t A, then each dy W accumulated onto it in place
            dx = torch.mm(t, down)
            for dy, w in zip(dys, weights):
                if dy is not None:
                    dx = ctx.linear(dy, w.t(), dx)
        d_down = torch.mm(t.t(), x2) if need_down else None
        hs = h.split(ctx.ranks, dim=1)
        d_w = [torch.mm(dy.t(), x2) if need and dy is not None else None
               for dy, need in zip(dys, need_w)]
        d_up = [torch.mm(dy.t(), hi) if need and dy is not None else None
                for dy, hi, need in zip(dys, hs, need_up)]
        return (dx, None, None, None, d_down, *d_w, *d_up)


def lora_linears(x: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]],
                 linear=None, narrow=None) -> list[torch.Tensor]:
    """``[lora_linear(x, w, None, down, up, alpha, linear=linear, narrow=narrow) for (w, down,
    up, alpha) in parts]`` as one autograd node (``_LoraLinears``): the linears share their
    input (q, k and v)."""
    dev, autocast, dt = _compute_dtype(x)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == dt else t.to(dt)

    down = torch.cat([cast(d) for _, d, _, _ in parts])
    ups = [cast(up * alpha if alpha != 1.0 else up) for _, _, up, alpha in parts]
    weights = [cast(w) for w, _, _, _ in parts]
    ranks = tuple(d.shape[0] for _, d, _, _ in parts)
    with torch.autocast(dev, enabled=False) if autocast else contextlib.nullcontext():
        ys = _LoraLinears.apply(cast(x).reshape(-1, x.shape[-1]), ranks, linear, narrow, down, *weights,
                                *ups)
    return [y.view(*x.shape[:-1], w.shape[0]) for y, (w, _, _, _) in zip(ys, parts)]


def folded_forward(lyco, x: torch.Tensor, linear=None, narrow=None) -> torch.Tensor:
    """A folding LoRA/LoCon module's forward (``runtime.folds``): ``base(x) + m * scale *
    up(down(x))`` with the delta rounded once, inside a matmul. On a plain linear the whole
    layer is one autograd node (``lora_linear``). On another base (a quantized linear runs
    its own matmul; another adapter's wrapper) the delta is accumulated onto the base
    output by one ``addmm``: no full-width temporary for the delta, its scaled copy or the
    sum. In place onto a quantized linear's output (its kernel keeps only its inputs);
    out of place onto another wrapper's (it may keep its output) and under a dispatch mode
    (a base output that selective checkpointing keeps is never mutated)."""
    alpha = float(lyco.scale) * float(lyco.multiplier)
    fp8 = fp8_fold_parts(lyco, x.dtype)
    if fp8 is not None:
        return fp8_lora_linears(x, [fp8], narrow)[0]
    if getattr(lyco.org_forward, "__func__", None) is nn.Linear.forward:
        base = lyco.org_module[0]  # kmoss_unevaluated: a recomputation reads no output
        down, up = lora_factors(lyco, linear_dtype(x))  # alpha in up, as lora_linear puts it
        return lora_linear(x, base.weight, base.bias, down, up, 1.0,
                           evaluate=not getattr(base, "kmoss_unevaluated", False), linear=linear,
                           narrow=narrow)
    y = lyco.org_forward(x)
    h = F.linear(x, lyco.lora_down.weight.to(x))
    up = lyco.lora_up.weight.to(y.dtype)
    if y.dim() == 2 and _owns_output(lyco) and not is_in_torch_dispatch_mode():
        # no copy of the base output; y itself, not a view of it (an in-place op on a view
        # makes autograd copy the whole gradient in backward)
        return y.addmm_(h.to(y.dtype), up.t(), alpha=alpha)
    y2, h2 = y.reshape(-1, y.shape[-1]), h.reshape(-1, h.shape[-1]).to(y.dtype)
    return torch.addmm(y2, h2, up.t(), alpha=alpha).view(y.shape)


def _owns_output(lyco) -> bool:
    """Whether the base output is the layer's own to accumulate into: a quantized linear's
    kernel (it keeps only its inputs), not another adapter's wrapper (which may keep it)."""
    base = lyco.org_module[0]
    return getattr(base, "codes", None) is not None and \
        getattr(lyco.org_forward, "__func__", None) is type(base).forward


def fp8_fold_parts(lyco, dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor, torch.Tensor] | None:
    """``(base, down, alpha * up)``, the factors in ``dtype`` (the input's; ``lora_factors``),
    when the layer's base runs fp8 compute and takes its LoRA into one node
    (``QuantizedLinear.lora_op``: no bias, no rotation), else None."""
    base = lyco.org_module[0]
    lora_op = getattr(base, "lora_op", None)
    if lora_op is None or not _owns_output(lyco) or lora_op() is None:
        return None
    return base, *lora_factors(lyco, dtype)


def fp8_lora_linears(x: torch.Tensor, parts: list[tuple[nn.Module, torch.Tensor, torch.Tensor]],
                     narrow=None) -> list[torch.Tensor]:
    """The fp8 linears ``parts`` (``fp8_fold_parts``, one input ``x``) with their LoRAs as one
    node: the base's op table's ``fp8_lora_linears``, its narrow products through ``narrow``
    (the adapter set's ``ops.narrow_mm``; None: the reference)."""
    base, held_t = parts[0][0], None
    if base.fp8_grad and not torch.compiler.is_compiling() and not is_in_torch_dispatch_mode():
        width = slot_width(sum(down.shape[0] for _, down, _ in parts))
        for b, _, _ in parts:  # once: the codes held beside their slot (no copy a forward)
            b.hold_slots(width)
        if base.keep_transposes and torch.is_grad_enabled():  # memory.fp8_transposes: made once, kept
            held_t = base.node_transposes([b for b, _, _ in parts], width)
    return base.lora_op()(x, [(b.codes, b.scale, down, up) for b, down, up in parts], base.fp8_grad,
                          narrow or ref_narrow_mm, held_t)
