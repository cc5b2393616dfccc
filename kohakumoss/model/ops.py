"""The op table: every numerically interesting op of the DiT forward, with its reference.

The model calls ``ops.<name>(...)`` and never chooses a backend itself; the kernel registry
replaces entries of an ``OpTable`` (``table.override(name, fn)``) with faster backends
that must match these references. Each reference computes in ``max(float32, input dtype)``
and rounds once to the input dtype, as the reference implementation does
(``spec/moss-image.md`` 5.2).

Legend: N tokens, B samples, H heads, Dh head dim, D width; ``seg`` [N] int64 sample id of
each token; per-sample modulation vectors ``shift``/``scale``/``gate`` are float32 [B, D].
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(torch.float32, dtype)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * w`` over the last dim (no ``1 +`` on the weight)."""
    return _rms(x.to(compute_dtype(x.dtype)), weight, eps).to(x.dtype)


def modulated_rms_norm(x_ND: torch.Tensor, weight: torch.Tensor, shift_BD: torch.Tensor,
                       scale_BD: torch.Tensor, seg_N: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm(x) * (1 + scale) + shift`` with the token's sample's vectors."""
    cd = compute_dtype(x_ND.dtype)
    y = _rms(x_ND.to(cd), weight, eps)
    return (y * (1 + scale_BD.to(cd)[seg_N]) + shift_BD.to(cd)[seg_N]).to(x_ND.dtype)


def rope_angles(pos_N4: torch.Tensor, bands: torch.Tensor, axes: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, Dh/2] in ``max(fp32, dtype)``: slot j uses axis j // NB, band j % NB."""
    cd = compute_dtype(dtype)
    nb = bands.numel()
    j = torch.arange(axes * nb, device=pos_N4.device)
    theta = pos_N4.to(cd)[:, j // nb] * bands.to(cd)[j % nb]
    return theta.cos(), theta.sin()


def qk_norm_rope(x_NHd: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """Per-head RMSNorm with the shared [Dh] weight, then split-half (NeoX) rotation."""
    cd = compute_dtype(x_NHd.dtype)
    y = _rms(x_NHd.to(cd), weight, eps)
    half = y.shape[-1] // 2
    y1, y2 = y[..., :half], y[..., half:]
    c, s = cos.to(cd)[:, None, :], sin.to(cd)[:, None, :]
    return torch.cat([y1 * c - y2 * s, y2 * c + y1 * s], dim=-1).to(x_NHd.dtype)


def situ(u: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``(4 tanh(g/4) sigmoid(g)) * (25 tanh(u/25))``."""
    cd = compute_dtype(u.dtype)
    uf, gf = u.to(cd), g.to(cd)
    return ((4 * torch.tanh(gf / 4) * torch.sigmoid(gf)) * (25 * torch.tanh(uf / 25))).to(u.dtype)


def residual(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    cd = compute_dtype(x.dtype)
    return (x.to(cd) + y.to(cd)).to(x.dtype)


def gated_residual(x_ND: torch.Tensor, y_ND: torch.Tensor, gate_BD: torch.Tensor,
                   seg_N: torch.Tensor) -> torch.Tensor:
    """``x + gate * y`` with the token's sample's gate, added in fp32, rounded once."""
    cd = compute_dtype(x_ND.dtype)
    return (x_ND.to(cd) + gate_BD.to(cd)[seg_N] * y_ND.to(cd)).to(x_ND.dtype)


def varlen_attention(q_NHd: torch.Tensor, k_NHd: torch.Tensor, v_NHd: torch.Tensor,
                     lengths: list[int]) -> torch.Tensor:
    """Softmax attention within each contiguous segment of ``lengths`` tokens."""
    out, start = [], 0
    scale = 1.0 / math.sqrt(q_NHd.shape[-1])
    for n in lengths:
        if n == 0:
            continue
        sl = slice(start, start + n)
        q, k, v = (t[sl].transpose(0, 1).unsqueeze(0) for t in (q_NHd, k_NHd, v_NHd))
        out.append(F.scaled_dot_product_attention(q, k, v, scale=scale)[0].transpose(0, 1))
        start += n
    return torch.cat(out) if out else q_NHd.new_zeros(q_NHd.shape)


def timestep_embedding(t_B: torch.Tensor, dim: int) -> torch.Tensor:
    """``[cos | sin](t * 10000^(-k/half))`` in float32, cos first."""
    half = dim // 2
    omega = torch.pow(10000.0, -torch.arange(half, dtype=torch.float32, device=t_B.device) / half)
    angles = t_B.float()[:, None] * omega[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


class _Recompute(torch.autograd.Function):
    """Run ``fn`` without saving its fp32 intermediates; recompute them in backward.

    The elementwise references upcast to fp32 and would otherwise keep several fp32 copies
    of every activation for autograd; this keeps only the inputs. Outputs and gradients are
    exactly those of ``fn`` under plain autograd.
    """

    @staticmethod
    def forward(ctx, fn, static, *tensors):
        ctx.fn, ctx.static = fn, static
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            return fn(*tensors, *static)

    @staticmethod
    def backward(ctx, grad):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.fn(*inputs, *ctx.static)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True) if wanted else ())
        return (None, None, *[next(grads) if t.requires_grad else None for t in inputs])


def recomputed(fn: Callable, n_tensors: int) -> Callable:
    """``fn(*tensors, *static)`` with its first ``n_tensors`` arguments as autograd inputs."""

    def op(*args):
        tensors, static = args[:n_tensors], args[n_tensors:]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return _Recompute.apply(fn, static, *tensors)
        return fn(*args)

    op.__qualname__ = f"recomputed({fn.__qualname__})"
    op.reference = fn
    return op


REFERENCE: dict[str, Callable] = {
    "rms_norm": recomputed(rms_norm, 2),
    "modulated_rms_norm": recomputed(modulated_rms_norm, 5),
    "rope_angles": rope_angles,
    "qk_norm_rope": recomputed(qk_norm_rope, 4),
    "situ": recomputed(situ, 2),
    "residual": recomputed(residual, 2),
    "gated_residual": recomputed(gated_residual, 4),
    "varlen_attention": varlen_attention,
    "timestep_embedding": timestep_embedding,
}


class OpTable:
    """Name -> implementation; starts as the references, backends override entries."""

    def __init__(self, ops: dict[str, Callable] | None = None):
        self._ops = dict(REFERENCE if ops is None else ops)

    def __getattr__(self, name: str) -> Callable:
        try:
            return self.__dict__["_ops"][name]
        except KeyError:
            raise AttributeError(f"op {name!r} is not in the op table") from None

    def override(self, name: str, fn: Callable) -> None:
        if name not in REFERENCE:
            raise KeyError(f"unknown op {name!r}; ops: {', '.join(REFERENCE)}")
        self._ops[name] = fn

    def names(self) -> dict[str, str]:
        return {k: getattr(v, "__qualname__", repr(v)) for k, v in self._ops.items()}


DEFAULT_OPS = OpTable()
