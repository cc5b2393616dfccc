"""The LoRA's narrow-output products, ``h = x A^T`` (forward) and ``t = dy B`` (backward),
as the fp8 LoRA node computes them (``kernels/fp8_compute.py``).

Each reads a whole activation or gradient ([tokens, 3,072-16,384]) to make a [tokens, r]
result, so it is bound by memory; cuBLAS runs some at about half the memory's speed (the
twelfth pass of docs/performance.md). ``BACKEND`` picks how they are made:

- ``cublas``: ``torch.mm(x, w)`` (the default);
- ``cublas-t``: the transposed product ``(w^T x^T)^T``, a [tokens, r] view with other tiles;
- ``triton``: ``triton_narrow.narrow_mm`` on CUDA (bf16, fp16), else as ``cublas``.

An experiment until measured in a step: ``bench/bench_train.py --narrow`` sets it for a run,
``bench/bench_lora_products.py`` times the three alone.
"""

from __future__ import annotations

import logging

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from kohakumoss.kernels.backends import triton_module
from kohakumoss.kernels.dispatch import failure_reason

log = logging.getLogger(__name__)

BACKENDS = ("cublas", "cublas-t", "triton")
BACKEND = "cublas"
_broken: list[str] = []  # why the Triton kernel failed, once it has


def narrow_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` for a tall x [M, K] and a narrow w [K, R], made as ``BACKEND`` says. The
    Triton kernel runs where no dispatch mode or compiler watches (they see aten ops); one
    that fails is said once and cuBLAS makes the products from then on."""
    if BACKEND == "cublas-t":
        return torch.mm(w.t(), x.t()).t()
    if BACKEND == "triton" and not _broken and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) \
            and w.shape[1] <= 256 and not torch.compiler.is_compiling() and not is_in_torch_dispatch_mode():
        module = triton_module("triton_narrow")
        if module is not None:
            try:
                return module.narrow_mm(x, w)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # a kernel that fails to build or run: cuBLAS from now on
                _broken.append(failure_reason(e))
                log.warning("narrow products: the Triton kernel failed (%s); using cuBLAS from now on",
                            _broken[0])
    return torch.mm(x, w)
