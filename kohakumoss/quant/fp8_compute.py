"""fp8 compute for the frozen base (``quant/ops.py``: ``fp8_linear``) on sm89 and later:
the forward is one ``torch._scaled_mm`` of float8_e4m3fn activations (quantized per row by
``triton_fp8.fp8_rows``) and weight codes (per output row), both row scales applied by
the GEMM, bf16 out, fast accumulation (``FAST_ACCUM_FORWARD``); the input gradient is the
bf16 path, ``dy @ (codes * scale)``, the weight dequantized into a transient bf16 buffer
(one layer's) and multiplied by cuBLAS, or with ``grad_fp8`` (``precision.fp8_compute:
full``) a second fp8 GEMM: ``(dy * scale)`` quantized per row (one Triton pass) times the
codes, transposed into a transient fp8 buffer.
Nothing is saved for backward but the codes and scales the layer holds anyway.

``torch._scaled_mm`` wants both sizes of the weight a multiple of 16 (every MOSS-Image
linear's are) and takes any token count. Its output is returned as made, not a view: a
LoRA accumulates onto it in place (``adapters/folded.py``); an in-place op on a view of it
would make autograd copy the whole gradient in backward.
"""

from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from kohakumoss.kernels.backends import triton_module
from kohakumoss.kernels.registry import register_backend


FAST_ACCUM_FORWARD = True
"""The forward GEMMs accumulate on the tensor cores without promoting their partial sums to
fp32 along the way (``use_fast_accum``; the input-gradient GEMMs too only in the
``scaled_mm_fast`` backends, registered below): the forward ran
10-15% faster at the model's sizes on the H200 (``docs/precision.md``), and its sums' error
stays far below the e4m3 rounding of the activations. The convention of NVIDIA's
Transformer Engine fp8 recipes (fast accumulation in fprop, split accumulation in the
gradients)."""


_ONES: dict[tuple[torch.device, int], torch.Tensor] = {}


def _ones(n: int, device: torch.device) -> torch.Tensor:
    """[1, n] float32 ones, the input-gradient GEMMs' column scales (the row scales moved onto
    ``dy``): made once per device and width, never written (a fill and its launch a backward
    otherwise; the fp8 step is bound by the host's launches)."""
    key = (device, n)
    if key not in _ONES:
        _ONES[key] = torch.ones((1, n), dtype=torch.float32, device=device)
    return _ONES[key]


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """CUDA compute capability 8.9+ (Ada, Hopper, Blackwell), bf16 activations."""
    return (dtype == torch.bfloat16 and device.type == "cuda" and torch.cuda.is_available()
            and torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 9)
            and triton_module("quant.triton_fp8") is not None and triton_module("quant.triton_quant") is not None)


class _ScaledMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, codes, scale, bias, grad_fp8, fast_grad):
        xq, xs = triton_module("quant.triton_fp8").fp8_rows(x2)
        y = torch._scaled_mm(xq, codes.t(), scale_a=xs[:, None], scale_b=scale[None, :],
                             out_dtype=x2.dtype, use_fast_accum=FAST_ACCUM_FORWARD)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(codes, scale)
        ctx.bias_grad, ctx.grad_fp8, ctx.fast_grad = bias is not None and bias.requires_grad, grad_fp8, fast_grad
        return y

    @staticmethod
    def backward(ctx, go):
        codes, scale = ctx.saved_tensors
        go = go.contiguous()
        tq, t8 = triton_module("quant.triton_quant"), triton_module("quant.triton_fp8")
        dx = None
        if ctx.needs_input_grad[0] and ctx.grad_fp8:
            # dy W = (dy * scale) codes: the codes transposed into a transient buffer (the
            # GEMM wants the summed dimension contiguous in both operands), no scale on them
            gq, gs = t8.fp8_rows(go, scale)
            ct = t8.transposed_codes([codes])
            dx = torch._scaled_mm(gq, ct.t(), scale_a=gs[:, None], scale_b=_ones(ct.shape[0], go.device),
                                  out_dtype=go.dtype, use_fast_accum=ctx.fast_grad)
        elif ctx.needs_input_grad[0]:
            dx = go @ tq.dequantize(codes, scale, go.dtype)
        return dx, None, None, go.float().sum(0) if ctx.bias_grad else None, None, None


def fp8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None, grad_fp8: bool = False, fast_grad: bool = False) -> torch.Tensor:
    """``ops.fp8_linear`` as fp8 GEMMs (``torch._scaled_mm``, row-wise scales); ``fast_grad``:
    the input gradient's GEMM (``grad_fp8``) accumulates fast (``scaled_mm_fast``)."""
    if codes.dtype != torch.float8_e4m3fn or x.dtype != torch.bfloat16:
        raise TypeError(f"fp8_linear (scaled_mm): codes {codes.dtype}, x {x.dtype}; want "
                        f"float8_e4m3fn codes and bf16 activations")
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    y = _ScaledMM.apply(x2, codes, scale, bias, grad_fp8, fast_grad)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], codes.shape[0])  # 2-D: no view (see above)


class _Fp8Loras(torch.autograd.Function):
    """``fp8_lora_linears``: bias-free fp8 linears on one input, each with a LoRA, one node.

    ``on`` (``full`` False). forward: ``h = x [A_1; ...]^T`` (one narrow product for every
    down matrix); ``x`` quantized once; per linear the fp8 GEMM, then ``h_i B_i^T`` accumulated
    onto its output in place. backward: ``t = [dy_1 B_1 | ...]``; one dequantized bf16 matmul
    per linear, accumulated onto ``t [A_1; ...]``: no full-width add, where separate nodes add
    three per linear.

    ``full``: no accumulation, the LoRAs' products ride in the fp8 GEMMs
    (``ops.fp8_lora_linears``). forward: ``[x | h g]`` quantized once, and each GEMM takes its
    codes widened by its up matrix's slot columns (``widened_codes``, a transient copy, one
    linear's at a time). backward: one GEMM over all the linears, the rows ``[dy_1 s_1 | ... |
    t g']`` (``fp8_rows_joined`` with a tail) against the codes' transposes side by side with
    ``A^T / g'`` beside them (``transposed_codes`` with a slot)."""

    @staticmethod
    def forward(ctx, x2, ranks, full, narrow, held_t, fast_grad, down, *tensors):
        n = len(ranks)
        codes, scales, ups = tensors[:n], tensors[n:2 * n], tensors[2 * n:]
        t8 = triton_module("quant.triton_fp8")
        ctx.narrow, ctx.held_t, ctx.fast_grad = narrow, held_t, fast_grad
        outs = []
        if full:  # the LoRAs' products inside the fp8 GEMMs: [x | h g] [codes | up / g]^T
            width, c0 = t8.slot_width(sum(ranks)), 0
            amax = t8.lora_amax(ups, scales)
            h = narrow(x2, down.t())
            xq, xs = t8.fp8_rows_joined([x2], None, (h, amax))
            for c, s, up in zip(codes, scales, ups):
                w = t8.slot_view(c, width)  # codes held widened: their slot written in place
                w = t8.widened_codes(c, up, s, amax, c0, width) if w is None else \
                    t8.filled_slots(w, up, s, amax, c0, width)
                outs.append(torch._scaled_mm(xq, w.t(), scale_a=xs[:, None], scale_b=s[None, :],
                                             out_dtype=x2.dtype, use_fast_accum=FAST_ACCUM_FORWARD))
                c0 += up.shape[1]
        else:
            h = narrow(x2, down.t())
            xq, xs = t8.fp8_rows(x2)
            for c, s, up, hi in zip(codes, scales, ups, h.split(ranks, dim=1)):
                y = torch._scaled_mm(xq, c.t(), scale_a=xs[:, None], scale_b=s[None, :], out_dtype=x2.dtype,
                                     use_fast_accum=FAST_ACCUM_FORWARD)
                outs.append(torch.addmm(y, hi, up.t()) if is_in_torch_dispatch_mode()
                            else y.addmm_(hi, up.t()))
        ctx.ranks, ctx.grad_fp8 = ranks, full
        ctx.save_for_backward(x2, h, down, *codes, *scales, *ups)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *dys):
        x2, h, down, *rest = ctx.saved_tensors
        n = len(ctx.ranks)
        codes, scales, ups = rest[:n], rest[n:2 * n], rest[2 * n:]
        need_x, need_down = ctx.needs_input_grad[0], ctx.needs_input_grad[6]
        need_up = ctx.needs_input_grad[7 + 2 * n:]
        dys = [dy.contiguous() if dy is not None else x2.new_zeros(x2.shape[0], c.shape[0])
               for dy, c in zip(dys, codes)]
        dx = t = None
        tq, t8 = triton_module("quant.triton_quant"), triton_module("quant.triton_fp8")
        if need_x and ctx.grad_fp8:  # one GEMM over every linear's output and t down
            # A's row maxima (ops.fp8_lora_slots of A^T, bit for bit) as one aten op, not a fill and a
            # Triton launch: this backward is bound by its host (ops.fp8_lora_linears)
            amax = torch.linalg.vector_norm(down, float("inf"), dim=1, dtype=torch.float32)
            cols = torch.cat(scales) if n > 1 else scales[0]
            t = _narrow_t(ctx.narrow, dys, ups)
            gq, gs = t8.fp8_rows_joined(dys, cols, (t, amax))
            ct = t8.transposed_codes(list(codes), (down, amax), ctx.held_t)
            dx = torch._scaled_mm(gq, ct.t(), scale_a=gs[:, None], scale_b=_ones(ct.shape[0], x2.device),
                                  out_dtype=x2.dtype, use_fast_accum=ctx.fast_grad)
        if t is None:
            t = _narrow_t(ctx.narrow, dys, ups)
        if need_x and not ctx.grad_fp8:
            dx = torch.mm(t, down)
            for dy, c, s in zip(dys, codes, scales):
                dx.addmm_(dy, tq.dequantize(c, s, dy.dtype))
        d_down = torch.mm(t.t(), x2) if need_down else None
        d_up = [torch.mm(dy.t(), hi) if need else None
                for dy, hi, need in zip(dys, h.split(ctx.ranks, dim=1), need_up)]
        return (dx, None, None, None, None, None, d_down, *([None] * 2 * n), *d_up)


def _narrow_t(narrow, dys: list[torch.Tensor], ups) -> torch.Tensor:
    """``t = [dy_1 B_1 | ...]`` by the table's narrow product."""
    return torch.cat([narrow(dy, up) for dy, up in zip(dys, ups)], 1) if len(dys) > 1 else narrow(dys[0], ups[0])


def fp8_lora_linears(x: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
                     full: bool = False, narrow=torch.mm, held_t: torch.Tensor | None = None,
                     fast_grad: bool = False) -> list[torch.Tensor]:
    """``ops.fp8_lora_linears`` as one node (``_Fp8Loras``): fp8 GEMMs, the LoRAs' products in
    bf16 accumulated in place, or with ``full`` inside the GEMMs; the narrow products
    (``x A^T``, ``dy B``) through ``narrow`` (the adapter set's ``ops.narrow_mm``). ``held_t``
    (``full``): the codes' transposes side by side, kept between steps
    (``transposed_codes``' ``held``), so that backward writes only their slot. ``fast_grad``
    (``full``; the ``scaled_mm_fast`` backends): the input gradient's GEMM accumulates fast."""
    if not 1 <= len(layers) <= 3 or len({c.shape[0] for c, _, _, _ in layers}) != 1:
        raise ValueError(f"fp8_lora_linears (scaled_mm): one to three linears of one width, got "
                         f"{[tuple(c.shape) for c, _, _, _ in layers]}")
    for codes, _, down, up in layers:
        if codes.dtype != torch.float8_e4m3fn or x.dtype != torch.bfloat16 or \
                down.dtype != x.dtype or up.dtype != x.dtype:
            raise TypeError(f"fp8_lora_linears (scaled_mm): codes {codes.dtype}, x {x.dtype}, "
                            f"LoRA {down.dtype}/{up.dtype}; want float8_e4m3fn codes, bf16 rest")
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    ranks = tuple(down.shape[0] for _, _, down, _ in layers)
    down = torch.cat([d for _, _, d, _ in layers]) if len(layers) > 1 else layers[0][2]
    ys = _Fp8Loras.apply(x2, ranks, full, narrow, held_t if full else None, fast_grad, down,
                         *(c for c, _, _, _ in layers),
                         *(s for _, s, _, _ in layers), *(u for _, _, _, u in layers))
    return [y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[1]) for y in ys]


register_backend("fp8_linear", "scaled_mm", fp8_linear, available, keeps_inputs_only=True)
register_backend("fp8_lora_linears", "scaled_mm", fp8_lora_linears, available)
# the same with fast accumulation in the input gradients' GEMMs too (fp8_compute: fast). The
# plain backends promote those GEMMs' partial sums to fp32 along the way (Transformer Engine's
# split accumulation for the gradients); precision.fp8_compute fast takes these (quant/plan.py:
# FAST_GRAD_BACKENDS); bench_train.py -S precision.fp8_compute=fast / full and bench_precision.py
# --grads measure the step and the LoRA gradients' error of each
register_backend("fp8_linear", "scaled_mm_fast", functools.partial(fp8_linear, fast_grad=True), available,
                 keeps_inputs_only=True)
register_backend("fp8_lora_linears", "scaled_mm_fast", functools.partial(fp8_lora_linears, fast_grad=True),
                 available)
