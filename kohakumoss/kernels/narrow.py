"""Backends of ``ops.narrow_mm``: the LoRA's narrow-output products, ``h = x A^T`` (forward)
and ``t = dy B`` (backward), which the LoRA nodes make with their model's table's op (the
bf16 node, ``adapters/folded.py``; the fp8 node, ``kernels/fp8_compute.py``).

Each reads a whole activation or gradient ([tokens, 3,072-16,384]) to make a [tokens, r]
result, so it is bound by memory; cuBLAS runs some at about half the memory's speed
(docs/history.md, "Tried and not kept"). The reference is ``torch.mm``; these make it other
ways, chosen by name (``bench/bench_train.py --kernels narrow_mm=triton`` for a run):

- ``cublas-t``: the transposed product ``(w^T x^T)^T``, a [tokens, r] view with other tiles;
- ``triton``: ``triton_narrow.narrow_mm`` where Triton runs, in bf16 or fp16 (interpreted:
  also fp32), r up to 256; other calls, and those a compiler or a dispatch mode watches (they
  see aten ops), go to ``torch.mm`` inside the backend.

Neither is a default: measured in a step, neither beat ``torch.mm`` (docs/history.md;
``bench/bench_lora_products.py`` times the three alone). A backend that raises is a
``dispatch.BackendFailed``.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from kohakumoss.kernels.backends import triton_module
from kohakumoss.kernels.registry import register_backend

def cublas_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` asked of cuBLAS as ``(w^T x^T)^T``."""
    return torch.mm(w.t(), x.t()).t()


def _kernel_takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    common = triton_module("triton_common")
    dtypes = (torch.bfloat16, torch.float16) + ((torch.float32,) if common.INTERPRETED else ())
    return x.dtype in dtypes and w.shape[1] <= 256 and common.can_run(x.device) \
        and not torch.compiler.is_compiling() and not is_in_torch_dispatch_mode()


def triton_narrow(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` by the Triton kernel where it takes the call, else ``torch.mm``."""
    if not _kernel_takes(x, w):
        return torch.mm(x, w)
    module = triton_module("triton_narrow")
    if module is None:
        raise RuntimeError("narrow_mm (triton): the Triton kernels cannot be imported here")
    return module.narrow_mm(x, w)


def _cuda(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def _triton(device: torch.device, dtype: torch.dtype) -> bool:
    common = triton_module("triton_common")
    return common is not None and triton_module("triton_narrow") is not None \
        and common.can_run(torch.device(device))


register_backend("narrow_mm", "cublas-t", cublas_t, _cuda)
register_backend("narrow_mm", "triton", triton_narrow, _triton)
