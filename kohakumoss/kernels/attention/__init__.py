"""Varlen attention (``model.ops.varlen_attention``): its problem shapes and its backends:
``flash_varlen`` and ``flex`` (torch's, ``varlen.py``: CUDA sm80+; flash bf16/fp16 with head
dims a multiple of 8 up to 256, flex fp32/bf16/fp16 with head dims a power of two from 16) and
``fa4`` (FlashAttention-4, the optional ``flash-attn-4`` package, the ``fa4`` extra: CUDA
sm90-sm110, bf16/fp16, head dims 32, 64, 96 and 128; ``fa4.py``, imported lazily). Each
declares its head-dim limits (``fits``)."""

from __future__ import annotations

import torch

from kohakumoss.kernels.attention import varlen
from kohakumoss.kernels.backends import triton_module, unavailable_reason
from kohakumoss.kernels.problems import Problem, lengths_of, rand, register_problem
from kohakumoss.kernels.registry import register_backend

FA4_MODULE = "kernels.attention.fa4"


def _make_attention(d, dtype, device, g, wg):
    q, k, v = (rand(g, device, dtype, d["N"], d["H"], d["Dh"]) for _ in range(3))
    return q, k, v, lengths_of(d["N"], d["L"])


def _fa4_available(device: torch.device, dtype: torch.dtype) -> bool:
    """bf16/fp16 on a card FA4 runs on, with ``flash-attn-4`` importable (asked in that order:
    its import takes seconds, so only where the card could use it)."""
    return (dtype in varlen.FLASH_DTYPES and varlen.fa4_card(torch.device(device))
            and triton_module(FA4_MODULE) is not None)


def _fa4_attention(q, k, v, lengths):
    module = triton_module(FA4_MODULE)
    if module is None:  # bad inputs still say so first (the module checks them itself)
        varlen._check("fa4", q, k, v, [int(n) for n in lengths])
        raise RuntimeError(f"varlen_attention (fa4): flash-attn-4 cannot be imported here "
                           f"({unavailable_reason(FA4_MODULE)}); pip install 'kohakumoss[fa4]'")
    return module.varlen_attention(q, k, v, lengths)


_fa4_attention.__qualname__ = "fa4.varlen_attention"

register_problem(Problem("varlen_attention",
                         lambda q, k, v, lengths: {"N": q.shape[0], "H": q.shape[1], "Dh": q.shape[2],
                                                   "L": max(lengths, default=0),
                                                   "S": sum(1 for n in lengths if n)},
                         ("N", "L", "H", "Dh"), _make_attention, tokens=("N", "L")))
register_backend("varlen_attention", "flash_varlen", varlen.flash_varlen_attention,
                 varlen.flash_available, fits=varlen.flash_fits)
register_backend("varlen_attention", "flex", varlen.flex_varlen_attention,
                 varlen.flex_available, fits=varlen.flex_fits)
register_backend("varlen_attention", "fa4", _fa4_attention, _fa4_available, fits=varlen.fa4_fits)
