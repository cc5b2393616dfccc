"""The Triton modulated norm's other forms (``model.ops.FORMS``), which ``model.ops`` takes
where a call runs the Triton kernels (``kernels/norm/__init__.py`` registers them):

- ``stream``: ``(norm(x), x)`` as one autograd node whose backward sums x's two gradients
  (the norm's own and the half's closing add's) in the norm's backward kernel
  (``ops.stream_norm``);
- ``added``: ``(norm(x + gate y), x + gate y)``: the add that closes a block's half made by
  the kernel of the norm that opens the next (``ops.added_norm``), its backward one kernel
  too.
"""

from __future__ import annotations

import torch

from kohakumoss.kernels.triton_common import check_tensors, lastdim_contiguous
from kohakumoss.kernels.norm.triton import (_backward, _check_mod, _forward, _mod_norm_impl,
                                            backward_added, modulated_rms_norm)


class _StreamNorm(torch.autograd.Function):
    """``(modulated_rms_norm(x, ...), x)`` as one node: x comes back (a view) for the residual
    add that closes the block's half, and the backward adds that add's gradient of x to the
    norm's own inside the kernel, one pass and one rounding where autograd would sum the two
    in a pass of its own."""

    @staticmethod
    def forward(ctx, x, weight, shift, scale, seg, eps):
        ctx.save_for_backward(x, weight, scale, seg)
        ctx.eps, ctx.dtypes = eps, (shift.dtype, scale.dtype)
        return _mod_norm_impl(x, weight, shift, scale, seg, eps), x.view_as(x)

    @staticmethod
    def backward(ctx, g, res):
        x, weight, scale, seg = ctx.saved_tensors
        need = ctx.needs_input_grad
        if g is None:  # the norm's output unused: x's gradient is the add's alone
            return res, None, None, None, None, None
        dx, dw, dshift, dscale = _backward(g, x, weight, scale, seg, ctx.eps, True, need[1],
                                           need[2] or need[3], res)
        return (dx, dw if need[1] else None, dshift.to(ctx.dtypes[0]) if need[2] else None,
                dscale.to(ctx.dtypes[1]) if need[3] else None, None, None)


def stream_modulated_rms_norm(x_ND: torch.Tensor, weight: torch.Tensor, shift_BD: torch.Tensor,
                              scale_BD: torch.Tensor, seg_N: torch.Tensor, eps: float
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(modulated_rms_norm(...), x)`` with x's two gradients summed in the norm's backward
    kernel (``ops.stream_norm``; ``_StreamNorm``). Without autograd or under
    ``torch.compile``: the norm and x itself."""
    if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and any(
            t.requires_grad for t in (x_ND, weight, shift_BD, scale_BD))):
        return modulated_rms_norm(x_ND, weight, shift_BD, scale_BD, seg_N, eps), x_ND
    _check_mod(x_ND, weight, shift_BD, scale_BD, seg_N)
    return _StreamNorm.apply(lastdim_contiguous(x_ND), lastdim_contiguous(weight),
                             lastdim_contiguous(shift_BD), lastdim_contiguous(scale_BD), seg_N,
                             float(eps))


def _added_impl(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                seg: torch.Tensor, eps: float, y: torch.Tensor, gate: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(x, weight, shift, scale, seg, eps, True, (y, gate))


_added_op = torch.library.custom_op("kohakumoss::triton_added_modulated_rms_norm", _added_impl,
                                    mutates_args=())


@_added_op.register_fake
def _(x, weight, shift, scale, seg, eps, y, gate):
    return torch.empty_like(x), torch.empty_like(x)


class _AddedNorm(torch.autograd.Function):
    """``(norm(s), s)``, ``s = x + gate y``, as one node, for x and y's gradients (the norm's
    weight, its modulation and the gate frozen: an adapter run). It keeps s (the stream, which
    the next half holds anyway), not x or y. Its backward is one pass: s's gradient (the
    norm's plus the later add's, ``gs``) is x's, and y's is ``gate`` times it."""

    @staticmethod
    def forward(ctx, x, weight, shift, scale, seg, eps, y, gate):
        out, s = _added_impl(x, weight, shift, scale, seg, eps, y, gate)
        ctx.save_for_backward(s, weight, scale, seg, gate)
        ctx.eps, ctx.y_dtype = eps, y.dtype
        return out, s

    @staticmethod
    def backward(ctx, g, gs):
        s, weight, scale, seg, gate = ctx.saved_tensors
        if g is None:  # the norm's output unused: s's gradient is the later add's alone
            ds = gs if gs is not None else torch.zeros_like(s)
            dy = (gate.float()[seg] * ds.float()).to(ctx.y_dtype)
        else:
            ds, dy = backward_added(g, s, weight, scale, seg, ctx.eps, gs, gate, ctx.y_dtype)
        return ds, None, None, None, None, None, dy, None


def added_modulated_rms_norm(x_ND: torch.Tensor, weight: torch.Tensor, shift_BD: torch.Tensor,
                             scale_BD: torch.Tensor, seg_N: torch.Tensor, eps: float,
                             y_ND: torch.Tensor, gate_BD: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(modulated_rms_norm(s, ...), s)`` with ``s = x + gate[seg] y`` (``ops.gated_residual``)
    in one kernel: the add that closes a block's half made by the norm that opens the next, so
    the stream is read once and written once (``ops.added_norm``). Under autograd, where only
    x and y take gradients, one node (``_AddedNorm``) whose backward is one kernel too. None
    (the caller makes the add and the norm apart) where the norm's weight, its modulation or
    the gate take gradients (a full finetune), and under ``torch.compile``."""
    args = (x_ND, weight, shift_BD, scale_BD, y_ND, gate_BD)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in args)
    if torch.compiler.is_compiling() or (grad and any(t.requires_grad for t in args[1:4] + args[5:])):
        return None
    _check_mod(x_ND, weight, shift_BD, scale_BD, seg_N)
    check_tensors("added_modulated_rms_norm", x_ND, y_ND, gate_BD)
    if y_ND.shape != x_ND.shape or y_ND.dtype != x_ND.dtype or gate_BD.shape != shift_BD.shape:
        raise ValueError(f"added_modulated_rms_norm (triton): y {tuple(y_ND.shape)} {y_ND.dtype}, "
                         f"gate {tuple(gate_BD.shape)}; want y as x, gate as shift")
    x, w, sh, sc, y, g = (lastdim_contiguous(t) for t in args)
    if grad:
        return _AddedNorm.apply(x, w, sh, sc, seg_N, float(eps), y, g)
    return _added_op(x, w, sh, sc, seg_N, float(eps), y, g)
