"""Attention backends for ``ops.varlen_attention(q, k, v, lengths)``: softmax attention
within each contiguous segment of ``lengths`` tokens, scale ``1 / sqrt(Dh)``.

- ``flash_varlen``: torch's own flash-attention varlen kernel
  (``torch.nn.attention.varlen.varlen_attn``, a custom op with its autograd) on the packed
  tokens with cumulative sequence lengths: one launch for every segment, no padding.
  CUDA, sm80+, bf16/fp16, head dim a multiple of 8 up to 256.
- ``fa4``: FlashAttention-4's kernels (the optional ``flash-attn-4`` package,
  ``kernels/attention/fa4.py``) on the packed tokens, one launch forward and backward.
  CUDA sm90-sm110, bf16/fp16, head dims 32, 64, 96 and 128.
- ``flex``: flex attention with a document mask (``segment(q) == segment(k)``), compiled
  with ``torch.compile`` on CUDA (fp32/bf16/fp16); on the CPU it runs eagerly, forward only
  (torch has no CPU flex backward).

Inputs a backend cannot take (an odd head dim, say) are passed over by the dispatch
(``fits``); a backend called directly gives them to the reference, said once in the log.

Legend: N packed tokens, H heads, Dh head dim, S segments.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import logging
import math

import torch

from kohakumoss.model import ops

log = logging.getLogger(__name__)

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLEX_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_warned: set[str] = set()


def _fallback(name: str, why: str, q, k, v, lengths):
    if why not in _warned:
        _warned.add(why)
        log.warning("varlen_attention=%s: %s; the reference runs instead", name, why)
    return ops.varlen_attention(q, k, v, lengths)


def _check(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths) -> None:
    if q.dim() != 3 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"varlen_attention ({name}): q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}; want three [N, H, Dh] of one shape")
    if any(n < 0 for n in lengths) or sum(lengths) != q.shape[0]:
        raise ValueError(f"varlen_attention ({name}): segment lengths sum to {sum(lengths)} "
                         f"(or one is negative) for {q.shape[0]} tokens")


@functools.lru_cache(maxsize=8)
def _cuda_sm80(device: torch.device) -> bool:
    return (device.type == "cuda" and torch.cuda.is_available() and torch.version.hip is None
            and torch.cuda.get_device_capability(device) >= (8, 0))


# ---- flash varlen --------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def flash_fits(dims) -> bool:
    """Flash's head dims: multiples of 8 up to 256."""
    return dims["Dh"] % 8 == 0 and dims["Dh"] <= 256


def flash_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (dtype in FLASH_DTYPES and _cuda_sm80(device) and _varlen_attn() is not None
            and torch.backends.cuda.is_flash_attention_available())


@functools.lru_cache(maxsize=64)
def _cu_seqlens(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(itertools.accumulate(lengths, initial=0)), dtype=torch.int32,
                        device=device)


def cu_seqlens(segs: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The segments' cumulative starts, int32 on ``device`` (kept per layout outside
    ``torch.compile``; made afresh inside it)."""
    if torch.compiler.is_compiling():
        return torch.tensor(list(itertools.accumulate(segs, initial=0)), dtype=torch.int32,
                            device=device)
    return _cu_seqlens(segs, device)


def flash_varlen_attention(q_NHd: torch.Tensor, k_NHd: torch.Tensor, v_NHd: torch.Tensor,
                           lengths: list[int]) -> torch.Tensor:
    """``ops.varlen_attention`` through torch's flash varlen kernel (forward and backward)."""
    _check("flash_varlen", q_NHd, k_NHd, v_NHd, lengths)
    Dh = q_NHd.shape[-1]
    if not flash_fits({"Dh": Dh}):
        return _fallback("flash_varlen", f"head dim {Dh} (flash takes multiples of 8 up to 256)",
                         q_NHd, k_NHd, v_NHd, lengths)
    if q_NHd.dtype not in FLASH_DTYPES or not _cuda_sm80(q_NHd.device):
        raise TypeError(f"varlen_attention (flash_varlen): {q_NHd.dtype} on {q_NHd.device}; "
                        f"flash takes float16/bfloat16 on CUDA sm80+")
    segs = tuple(int(n) for n in lengths if n > 0)
    if not segs:
        return q_NHd.new_zeros(q_NHd.shape)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_NHd, k_NHd, v_NHd))
    cu = cu_seqlens(segs, q.device)
    return _varlen_attn()(q, k, v, cu, cu, max(segs), max(segs))


# ---- FlashAttention-4 (its kernels: kernels/attention/fa4.py) ------------------------------

def fa4_fits(dims) -> bool:
    """The head dims FA4 is offered at: multiples of 32 up to 128, the ones checked against
    the reference on an H200 (flash-attn-4 4.0.0b40 there gave a head dim of 16 a wrong dq:
    zero for every segment after the first)."""
    return dims["Dh"] % 32 == 0 and 32 <= dims["Dh"] <= 128


@functools.lru_cache(maxsize=8)
def fa4_card(device: torch.device) -> bool:
    """A card FA4's forward and backward both run on: sm90 (Hopper), sm100/sm110 (Blackwell)."""
    return (device.type == "cuda" and torch.cuda.is_available() and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] in (9, 10, 11))


# ---- flex attention with a document mask ---------------------------------------------------

def tilelang_fits(dims) -> bool:
    """TileLang's head dims: multiples of 32 up to 256 (its backward's shared tiles take no
    others; ``experimental/tilelang/ops.py``)."""
    return dims["Dh"] % 32 == 0 and dims["Dh"] <= 256


def flex_fits(dims) -> bool:
    """Flex's head dims here: powers of two from 16."""
    return dims["Dh"] >= 16 and dims["Dh"] & (dims["Dh"] - 1) == 0


def flex_available(device: torch.device, dtype: torch.dtype) -> bool:
    if dtype not in FLEX_DTYPES or not _cuda_sm80(device):
        return False
    try:
        importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention)  # static first, dynamic once a second N is seen


@functools.lru_cache(maxsize=16)
def _document_mask(lengths: tuple[int, ...], device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    n = sum(lengths)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                  torch.tensor(lengths, device=device))

    def same_segment(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    return create_block_mask(same_segment, None, None, n, n, device=device)


def flex_varlen_attention(q_NHd: torch.Tensor, k_NHd: torch.Tensor, v_NHd: torch.Tensor,
                          lengths: list[int]) -> torch.Tensor:
    """``ops.varlen_attention`` through flex attention with a document mask."""
    _check("flex", q_NHd, k_NHd, v_NHd, lengths)
    if q_NHd.dtype not in FLEX_DTYPES:
        raise TypeError(f"varlen_attention (flex): a {q_NHd.dtype} input; flex takes "
                        f"float32, float16 and bfloat16")
    Dh = q_NHd.shape[-1]
    if not flex_fits({"Dh": Dh}):
        return _fallback("flex", f"head dim {Dh} (flex takes powers of two from 16)",
                         q_NHd, k_NHd, v_NHd, lengths)
    if q_NHd.shape[0] == 1:  # seen on an H200, torch 2.11: flex's dq of one lone token is wrong
        return _fallback("flex", "a single token", q_NHd, k_NHd, v_NHd, lengths)
    segs = tuple(int(n) for n in lengths if n > 0)
    if not segs:
        return q_NHd.new_zeros(q_NHd.shape)
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q_NHd, k_NHd, v_NHd))  # [1, H, N, Dh]
    if q_NHd.device.type == "cpu":
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise RuntimeError("varlen_attention (flex): torch has no flex attention backward on "
                               "the CPU; use the reference there")
        from torch.nn.attention.flex_attention import flex_attention
        fn = flex_attention
    else:
        fn = _compiled_flex()
    # compiled flex donates its saved buffers to the backward: its graph is differentiated
    # once (as a training step does), not with retain_graph=True (H200, torch 2.11: the
    # failures once blamed on flex's numbers were a test retaining the graph)
    out = fn(q, k, v, block_mask=_document_mask(segs, q_NHd.device), scale=1.0 / math.sqrt(Dh))
    return out.squeeze(0).transpose(0, 1)  # squeeze: a view in backward too
