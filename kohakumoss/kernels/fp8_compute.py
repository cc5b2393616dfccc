"""fp8 compute for the frozen base (``model/ops.py``: ``fp8_linear``) on sm89 and later:
the forward is one ``torch._scaled_mm`` of float8_e4m3fn activations (quantized per row by
``triton_quant.fp8_rows``) and weight codes (per output row), both row scales applied by
the GEMM, bf16 out; the input gradient is the bf16 path, ``dy @ (codes * scale)``, the
weight dequantized into a transient bf16 buffer (one layer's) and multiplied by cuBLAS, or
with ``grad_fp8`` (``precision.fp8_compute: full``) a second fp8 GEMM:
``(dy * scale)`` quantized per row (one Triton pass) times the codes, transposed into a
transient fp8 buffer.
Nothing is saved for backward but the codes and scales the layer holds anyway.

``torch._scaled_mm`` wants both sizes of the weight a multiple of 16 (every MOSS-Image
linear's are) and takes any token count. Its output is returned as made, not a view: a
LoRA accumulates onto it in place (``adapters/folded.py``); an in-place op on a view of it
would make autograd copy the whole gradient in backward.
"""

from __future__ import annotations

import torch

from kohakumoss.kernels.backends import triton_module
from kohakumoss.kernels.registry import register_backend


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """CUDA compute capability 8.9+ (Ada, Hopper, Blackwell), bf16 activations."""
    return (dtype == torch.bfloat16 and device.type == "cuda" and torch.cuda.is_available()
            and torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 9)
            and triton_module("triton_quant") is not None)


class _ScaledMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, codes, scale, bias, grad_fp8):
        tq = triton_module("triton_quant")
        xq, xs = tq.fp8_rows(x2)
        y = torch._scaled_mm(xq, codes.t(), scale_a=xs[:, None], scale_b=scale[None, :],
                             out_dtype=x2.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(codes, scale)
        ctx.bias_grad, ctx.grad_fp8 = bias is not None and bias.requires_grad, grad_fp8
        return y

    @staticmethod
    def backward(ctx, go):
        codes, scale = ctx.saved_tensors
        go = go.contiguous()
        tq = triton_module("triton_quant")
        dx = None
        if ctx.needs_input_grad[0] and ctx.grad_fp8:
            # dy W = (dy * scale) codes: the codes transposed into a transient buffer (the
            # GEMM wants the summed dimension contiguous in both operands), no scale on them
            gq, gs = tq.fp8_rows(go, scale)
            ct = codes.t().contiguous()
            ones = torch.ones((1, ct.shape[0]), dtype=torch.float32, device=go.device)
            dx = torch._scaled_mm(gq, ct.t(), scale_a=gs[:, None], scale_b=ones, out_dtype=go.dtype)
        elif ctx.needs_input_grad[0]:
            dx = go @ tq.dequantize(codes, scale, go.dtype)
        return dx, None, None, go.float().sum(0) if ctx.bias_grad else None, None


def fp8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None, grad_fp8: bool = False) -> torch.Tensor:
    """``ops.fp8_linear`` as fp8 GEMMs (``torch._scaled_mm``, row-wise scales)."""
    if codes.dtype != torch.float8_e4m3fn or x.dtype != torch.bfloat16:
        raise TypeError(f"fp8_linear (scaled_mm): codes {codes.dtype}, x {x.dtype}; want "
                        f"float8_e4m3fn codes and bf16 activations")
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    y = _ScaledMM.apply(x2, codes, scale, bias, grad_fp8)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], codes.shape[0])  # 2-D: no view (see above)


register_backend("fp8_linear", "scaled_mm", fp8_linear, available, keeps_inputs_only=True)
