"""TileLang's kernels, opt-in (``kernels.backends`` naming ``tilelang`` loads this package):

- ``tilelang`` (rms_norm, modulated_rms_norm, situ, gated_residual, varlen_attention): CUDA
  sm70+ (bf16 from sm80; attention bf16/fp16, head dims a multiple of 32 up to 256): the fused
  kernels of sm70 / sm75, where Triton does not run (``ops.py``, ``kernels.py``); on sm80+
  the tuner times them only when named (``opt_in``): their first build is nvcc seconds;
- ``tilelang`` (linear): the block linears' products as a TileLang GEMM (``gemm.py``), forward
  and input gradient, the LoRA nodes' accumulating base products too; CUDA sm80+, bf16/fp16,
  K and O multiples of 8.

TileLang itself is imported lazily, on the first availability question or call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kohakumoss.kernels.attention import varlen
from kohakumoss.kernels.backends import triton_module, unavailable_reason
from kohakumoss.kernels.registry import register_backend

NAME = "tilelang"
OPS_MODULE, GEMM_MODULE = "experimental.tilelang.ops", "experimental.tilelang.gemm"
OPS = ("rms_norm", "modulated_rms_norm", "situ", "gated_residual", "varlen_attention")


def _available(op: str, module_name: str = OPS_MODULE) -> Callable[[torch.device, torch.dtype], bool]:
    def available(device: torch.device, dtype: torch.dtype) -> bool:
        if torch.device(device).type != "cuda":  # asked before TileLang is imported
            return False
        module = triton_module(module_name)
        return module is not None and (module.can_run(device, dtype, True) if op == "varlen_attention"
                                       else module.can_run(device, dtype))

    return available


def _fn(op: str, module_name: str = OPS_MODULE) -> Callable:
    def fn(*args):
        module = triton_module(module_name)
        if module is None:
            raise RuntimeError(f"{op} (tilelang): TileLang cannot be imported here "
                               f"({unavailable_reason(module_name)})")
        return getattr(module, op)(*args)

    fn.__name__, fn.__qualname__ = op, f"tilelang.{op}"
    return fn


def _sm80_or_newer(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


for _op in OPS:  # the norms, SiTU and the gated add keep their inputs only
    register_backend(_op, NAME, _fn(_op), _available(_op),
                     fits=varlen.tilelang_fits if _op == "varlen_attention" else None,
                     keeps_inputs_only=_op != "varlen_attention", opt_in=_sm80_or_newer)
register_backend("linear", NAME, _fn("linear", GEMM_MODULE), _available("linear", GEMM_MODULE),
                 fits=lambda dims: dims["K"] % 8 == 0 and dims["O"] % 8 == 0,
                 keeps_inputs_only=True, opt_in=_sm80_or_newer)
