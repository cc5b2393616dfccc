"""The quantized base's ops served by the kernel registry: their contract (``quant.ops.QUANT``),
their problem shapes, and their backends, registered when ``kohakumoss.quant.linear`` (or this
module) is imported.

- ``triton`` (quant_linear): the int8 / fp8 weight codes widened tile by tile inside the
  matmul (``quant/triton_quant.py``); ``dequant_mm`` (quant_linear, from ``DEQUANT_ROWS``
  rows): the layer's weight dequantized into a transient buffer, then cuBLAS;
- ``scaled_mm`` / ``scaled_mm_fast`` (fp8_linear, fp8_lora_linears): fp8 GEMMs on sm89+,
  bf16 activations (``quant/fp8_compute.py``).

``quant.plan.DEFAULT_BACKENDS`` says which a run takes where the tuning table does not.
"""

from __future__ import annotations

import torch

from kohakumoss.kernels.backends import triton_available, triton_fn
from kohakumoss.kernels.problems import Problem, rand, register_problem, rows
from kohakumoss.kernels.registry import register_backend, register_contract
from kohakumoss.quant.ops import QUANT

TRITON_MODULE = "quant.triton_quant"

DEQUANT_ROWS = 1024
"""From this many rows a quantized linear dequantizes the layer's weight into a transient
buffer for cuBLAS (``dequant_mm``): one pass over the weight costs less than what the fused
Triton kernel gives up to the vendor GEMM (the H200: 1.41 against 1.03 s per 4-sample step,
docs/performance.md); fewer rows (text tokens, sampling one image) keep the fused kernel."""


def _make_quant(d, dtype, device, g, wg):
    codes = torch.randint(-127, 128, (d["O"], d["K"]), generator=g, device=device, dtype=torch.int8)
    scale = torch.rand(d["O"], generator=g, device=device) * 1e-3
    return rand(g, device, dtype, d["N"], d["K"]), codes, scale, None


register_contract(QUANT)
register_problem(Problem(
    "quant_linear",
    lambda x, codes, scale, bias: {"N": rows(x), "K": x.shape[-1], "O": codes.shape[0]},
    ("N", "K", "O"), _make_quant))
register_backend("quant_linear", "triton", triton_fn("quant_linear", "quant_linear", TRITON_MODULE),
                 triton_available("quant_linear", TRITON_MODULE), keeps_inputs_only=True)
register_backend("quant_linear", "dequant_mm", triton_fn("quant_linear", "dequant_linear", TRITON_MODULE),
                 triton_available("quant_linear", TRITON_MODULE),
                 fits=lambda dims: dims["N"] >= DEQUANT_ROWS, keeps_inputs_only=True)

from kohakumoss.quant import fp8_compute  # noqa: E402,F401  (registers scaled_mm)
