"""``varlen_attention`` through FlashAttention-4's kernels (the ``flash-attn-4`` package,
written in NVIDIA's CuTe DSL and compiled on first use): one launch over every packed
segment, forward and backward, on Hopper (sm90) and Blackwell (sm100/sm110) in bf16/fp16.
Importing this module imports ``flash_attn.cute`` (~8 s, CUTLASS's MLIR libraries); the
registry does so only where the card could run it (``kernels/attention/__init__.py``).

The kernels are entered the way torch's own FA4 hook (``torch.nn.attention._fa4``) enters
them, through ``_flash_attn_fwd`` / ``_flash_attn_bwd``, wrapped here as ``torch.library``
custom ops with fake and autograd registrations (``custom.entry``). The backward is
deterministic when torch's deterministic algorithms are on (its dQ is otherwise summed by
atomics). Legend: N packed tokens, H heads, Dh head dim.
"""

from __future__ import annotations

import math
import types
from collections.abc import Mapping

import torch
from flash_attn.cute import interface as _fa4

from kohakumoss.kernels.attention import varlen as attention
from kohakumoss.kernels.custom import entry, like


FWD_LAUNCH: Mapping = types.MappingProxyType({})
"""The forward's launch arguments of ``_flash_attn_fwd`` (``tile_mn``, ``mma_pv_is_rs``,
``intra_wg_overlap``): none, the package's own choice (for head dim 128 on sm90, 128 x 128
tiles), as ``bench/bench_fa4_configs.py --passes fwd`` found the others within the spread in
a sampling run (docs/history.md, "Attention")."""


def _fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
              longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse, *_ = _fa4._flash_attn_fwd(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
        softmax_scale=1.0 / math.sqrt(q.shape[-1]), return_lse=True, **FWD_LAUNCH)
    return out, lse


def _bwd_impl(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              o: torch.Tensor, lse: torch.Tensor, cu: torch.Tensor, longest: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _fa4._flash_attn_bwd(
        q, k, v, o, do.contiguous(), lse, 1.0 / math.sqrt(q.shape[-1]), False, 0.0,
        cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
        deterministic=torch.are_deterministic_algorithms_enabled())[:3]
    return dq, dk, dv


_fwd_op = torch.library.custom_op("kohakumoss::fa4_attention", _fwd_impl, mutates_args=())
_fwd_op.register_fake(lambda q, k, v, cu, longest: (like(q), like(q, (q.shape[1], q.shape[0]),
                                                                   torch.float32)))
_bwd_op = torch.library.custom_op("kohakumoss::fa4_attention_bwd", _bwd_impl, mutates_args=())
_bwd_op.register_fake(lambda do, q, k, v, o, lse, cu, longest: (like(q), like(k), like(v)))


def _setup(ctx, inputs, output):
    q, k, v, cu, longest = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu)
    ctx.longest = longest
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, cu = ctx.saved_tensors
    dq, dk, dv = ctx.bwd(do, q, k, v, o, lse, cu, ctx.longest)
    return dq, dk, dv, None, None


_attn = entry(_fwd_op, _fwd_impl, _setup, _backward, _bwd_op, _bwd_impl)


def varlen_attention(q_NHd: torch.Tensor, k_NHd: torch.Tensor, v_NHd: torch.Tensor,
                     lengths: list[int]) -> torch.Tensor:
    """``ops.varlen_attention`` through FlashAttention-4: softmax attention within each
    contiguous segment, scale ``1 / sqrt(Dh)``."""
    lengths = [int(n) for n in lengths]
    attention._check("fa4", q_NHd, k_NHd, v_NHd, lengths)
    Dh = q_NHd.shape[-1]
    if not attention.fa4_fits({"Dh": Dh}):
        return attention._fallback("fa4", f"head dim {Dh} (FA4 is offered at 32, 64, 96 and 128)",
                                   q_NHd, k_NHd, v_NHd, lengths)
    if q_NHd.dtype not in attention.FLASH_DTYPES or not attention.fa4_card(q_NHd.device):
        raise TypeError(f"varlen_attention (fa4): {q_NHd.dtype} on {q_NHd.device}; FA4 takes "
                        f"float16/bfloat16 on CUDA sm90-sm110")
    segs = tuple(n for n in lengths if n > 0)
    if not segs:
        return q_NHd.new_zeros(q_NHd.shape)
    cu = attention.cu_seqlens(segs, q_NHd.device)
    o, _ = _attn(q_NHd.contiguous(), k_NHd.contiguous(), v_NHd.contiguous(), cu, max(segs))
    return o
