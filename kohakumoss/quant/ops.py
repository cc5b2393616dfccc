"""The quantized base's ops and their references (``QUANT``: a contract of its own, whose
table the quantized linears share, ``kohakumoss.quant.linear``): ``quant_linear``,
``fp8_linear``, ``fp8_lora_linears``, and the row quantization they share.

``codes`` [out, in] int8 or float8_e4m3fn, ``scale`` float32 [out]: the weight is
``codes * scale[:, None]``, one scale per output row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

FP8_MAX = 448.0  # the largest float8_e4m3fn


def slot_width(r: int) -> int:
    """The columns r LoRA columns take in an fp8 GEMM's summed dimension (``fp8_lora_linears``
    with ``full``, as the kernels run it): r rounded up to 16 (``torch._scaled_mm`` wants
    every size a multiple of 16); the extra ones are zero."""
    return -(-r // 16) * 16


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes * scale[:, None]`` in float32, rounded once to ``dtype``."""
    return (codes.float() * scale.float()[:, None]).to(dtype)


def quant_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """Weight-only quantized linear: the linear of the weight dequantized to x's dtype (what
    a model holding that weight in x's dtype computes)."""
    return F.linear(x, dequantize_rows(codes, scale, x.dtype), None if bias is None else bias.to(x.dtype))


def fp8_rows(x: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise float8_e4m3fn codes of ``x`` [M, K] and their float32 scales [M]:
    ``scale = amax(|row|) / 448`` (a zero row: scale 1), codes rounded to nearest. With
    ``col_scale`` [K]: those of ``x * col_scale``, the product in float32."""
    xf = x.float() if col_scale is None else x.float() * col_scale.float()[None, :]
    s = xf.abs().amax(dim=-1) / FP8_MAX
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (xf / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, codes, scale, bias, grad_fp8):
        xq, xs = fp8_rows(x.reshape(-1, x.shape[-1]))
        xq, xs = xq.view(x.shape), xs.view(*x.shape[:-1], 1)  # the output made in x's shape:
        y = (xq.float() @ codes.float().t()) * xs * scale.float()  # not a view (accumulated into)
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(codes, scale)
        ctx.bias_grad, ctx.grad_fp8 = bias is not None and bias.requires_grad, grad_fp8
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, go):
        codes, scale = ctx.saved_tensors
        g2 = go.reshape(-1, go.shape[-1])
        if ctx.grad_fp8:  # dy W = (dy * s) codes: dy * s quantized per row, exact products
            gq, gs = fp8_rows(g2, scale)
            dx = ((gq.float() @ codes.float()) * gs[:, None]).to(go.dtype)
        else:  # the input gradient in the compute dtype
            dx = g2 @ dequantize_rows(codes, scale, go.dtype)
        db = g2.float().sum(0) if ctx.bias_grad else None
        return dx.view(*go.shape[:-1], codes.shape[1]), None, None, db, None


def fp8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None, grad_fp8: bool = False) -> torch.Tensor:
    """fp8 compute: x quantized per row to float8_e4m3fn, multiplied with the fp8 weight codes
    (exact products, float32 sums), scaled by both row scales, rounded once to x's dtype. The
    input gradient is that of the dequantized weight (x's rounding passes straight through)
    in x's dtype or, with ``grad_fp8``, an fp8 product too: ``dy W = (dy * scale) codes``,
    ``dy * scale`` quantized per row to float8_e4m3fn, rescaled and rounded once."""
    return _Fp8Linear.apply(x, codes, scale, bias, grad_fp8)


def fp8_lora_slots(up: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A LoRA's ``up`` [out, r] as r extra columns of its fp8 linear's codes (``scale`` [out],
    every one positive): per column j the factor ``g_j = max_n |up[n, j] / s_n| / 448`` and
    the codes ``up[n, j] / (s_n g_j)`` in float8_e4m3fn (a zero column: g 0, codes 0). Under
    row n's scale they stand for ``up / g``, their largest magnitude 448; the activations
    carry ``h g`` (``fp8_lora_linears`` with ``full``)."""
    u, s = up.float(), scale.float()[:, None]
    g = (u.abs() / s).amax(dim=0) / FP8_MAX
    d = s * g
    q = torch.where(g > 0, u / torch.where(d > 0, d, 1.0), 0.0).clamp(-FP8_MAX, FP8_MAX)
    return g, q.to(torch.float8_e4m3fn)


class _Fp8Loras(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, full, ranks, down, *tensors):
        n = len(ranks)
        codes, scales, ups = tensors[:n], tensors[n:2 * n], tensors[2 * n:]
        h = (x2.float() @ down.float().t()).to(x2.dtype)  # the narrow product, rounded
        if full:  # each LoRA's up matrix as extra columns of its codes, h g as extra activations
            slots = [fp8_lora_slots(up, s) for up, s in zip(ups, scales)]
            g = torch.cat([gi for gi, _ in slots])
            xq, xs = fp8_rows(torch.cat([x2.float(), h.float() * g], dim=1))
            xq, hq = xq.float().split([x2.shape[1], g.numel()], dim=1)
            outs = [((xq @ c.float().t() + hi @ q.float().t()) * xs[:, None] * s.float()).to(x2.dtype)
                    for c, s, hi, (_, q) in zip(codes, scales, hq.split(ranks, dim=1), slots)]
        else:
            xq, xs = fp8_rows(x2)
            outs = [((xq.float() @ c.float().t()) * xs[:, None] * s.float() + hi.float() @ up.float().t()
                     ).to(x2.dtype) for c, s, up, hi in zip(codes, scales, ups, h.split(ranks, dim=1))]
        ctx.ranks, ctx.grad_fp8 = ranks, full
        ctx.save_for_backward(x2, h, down, *tensors)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *dys):
        x2, h, down, *rest = ctx.saved_tensors
        n = len(ctx.ranks)
        codes, scales, ups = rest[:n], rest[n:2 * n], rest[2 * n:]
        dys = [dy if dy is not None else x2.new_zeros(x2.shape[0], c.shape[0]) for dy, c in zip(dys, codes)]
        t = torch.cat([(dy.float() @ up.float()).to(dy.dtype) for dy, up in zip(dys, ups)], dim=1)
        if ctx.grad_fp8:  # every linear's dy times its scales and t g', per row as one row,
            gd, qd = fp8_lora_slots(down.t(), torch.ones(down.shape[1], device=down.device))
            gq, gs = fp8_rows(torch.cat([torch.cat(dys, dim=1).float() * torch.cat(scales).float(),
                                         t.float() * gd], dim=1))  # against [codes | down^T / g']
            gq, tq = gq.float().split([gq.shape[1] - gd.numel(), gd.numel()], dim=1)
            dx = ((gq @ torch.cat(codes).float() + tq @ qd.float().t()) * gs[:, None]).to(x2.dtype)
        else:
            base = sum(dy.float() @ dequantize_rows(c, s, dy.dtype).float()
                       for dy, c, s in zip(dys, codes, scales))
            dx = (base + t.float() @ down.float()).to(x2.dtype)
        d_down = (t.float().t() @ x2.float()).to(down.dtype)
        d_up = [(dy.float().t() @ hi.float()).to(up.dtype)
                for dy, hi, up in zip(dys, h.split(ctx.ranks, dim=1), ups)]
        return (dx, None, None, d_down, *([None] * 2 * n), *d_up)


def fp8_lora_linears(x: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
                     full: bool = False, narrow: Callable | None = None,
                     held_t: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Bias-free ``fp8_linear``s reading one input, each with a LoRA, as one node: per
    ``(codes, scale, down, up)`` (``down`` [r, in] and ``up`` [out, r] in x's dtype, the
    LoRA's scale already in ``up``) ``fp8_linear(x, codes, scale) + (x down^T) up^T``, the
    narrow product ``h = x down^T`` rounded to x's dtype, the rest summed in float32 and
    rounded once.

    ``full`` (``precision.fp8_compute: full``): the LoRA's forward product rides in the fp8
    product too. Each linear's codes gain ``up``'s columns (``fp8_lora_slots``: ``up / g`` in
    e4m3 under the row's own scale), the activations gain ``h g``, and the row ``[x | h g]``
    is quantized under one scale: ``[x | h g] [W | up / g]^T = x W^T + h up^T``, every factor
    rounded to e4m3. The input gradient likewise: the rows of ``[dy_1 s_1 | dy_2 s_2 | ... |
    t g']`` (``t = [dy_1 up_1 | ...]``, rounded to x's dtype) quantized to e4m3 under one
    scale per row, times the codes stacked with ``down^T / g'`` (``fp8_lora_slots(down^T,
    1)``): one product for the base's part and the LoRAs' ``t down``. Without ``full``, each
    ``dy_i`` times its dequantized weight, plus ``t down``. The LoRAs' own gradients are
    those of ``h up^T`` unrounded (straight through). ``narrow``: the adapter set's ``narrow_mm``,
    which a backend's node makes h and t with; the reference makes them in fp32, rounded
    once. ``held_t``: the codes' transposes a backend's backward may read instead of making
    them (kept between steps, ``QuantizedLinear.node_transposes``); the reference does not
    need them."""
    x2 = x.reshape(-1, x.shape[-1])
    ranks = tuple(down.shape[0] for _, _, down, _ in layers)
    down = torch.cat([d for _, _, d, _ in layers])
    ys = _Fp8Loras.apply(x2, full, ranks, down, *(c for c, _, _, _ in layers),
                         *(s for _, s, _, _ in layers), *(u for _, _, _, u in layers))
    return [y.view(*x.shape[:-1], y.shape[1]) for y in ys]


QUANT: dict[str, Callable] = {
    "quant_linear": quant_linear,
    "fp8_linear": fp8_linear,
    "fp8_lora_linears": fp8_lora_linears,
}
"""The quantized base's ops: a table of its own (``OpTable(QUANT)``, made by the kernel
registry as the DiT's is), which every ``QuantizedLinear`` of one model shares."""
