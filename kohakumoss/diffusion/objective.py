"""The rectified-flow objective on packed image tokens (``docs/diffusion.md#training-objective``).

Legend: N image tokens of a micro-batch, C = 128 channels, B samples, ``seg`` [N] the
sample of each token. ``z = (1 - s) x0 + s eps``, target ``eps - x0``; the per-token error
(mean over channels) is weighted per sample (dataset loss weight x sigma weighting),
summed, and divided by the loss-token count of the whole optimiser step (all
micro-batches, all ranks), so the loss is a per-token mean however the step is split.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kohakumoss.model.ops import OpTable


def noised(x0_NC: torch.Tensor, eps_NC: torch.Tensor, sigma_N: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(z_sigma, target) in float32."""
    x0, eps, s = x0_NC.float(), eps_NC.float(), sigma_N.float()[:, None]
    return x0 + s * (eps - x0), eps - x0




WEIGHTINGS = ("none", "x0", "eps", "logit_normal", "min_snr")


def sigma_weight(sigma_B: torch.Tensor, weighting: str = "none", *, mean: float = 0.0,
                 std: float = 1.0, gamma: float = 5.0) -> torch.Tensor:
    """Each sample's loss factor at its noise level ``s`` (``docs/diffusion.md#loss-and-weighting``):
    ``none`` 1 (uniform: the MOSS recipe); ``x0`` s^2; ``eps`` (1 - s)^2; ``logit_normal``
    the logit-normal density at ``s`` (location ``mean``, scale ``std``: SD3's weighting,
    the mid noise levels counted most); ``min_snr`` min((1 - s)^2, gamma s^2), Min-SNR-gamma
    on x0 (min(SNR, gamma), SNR = ((1 - s) / s)^2) carried to the velocity loss, whose x0
    error is s times its own: the clean end's weight capped at gamma s^2."""
    s = sigma_B.float()
    if weighting == "none":
        return torch.ones_like(s)
    if weighting == "x0":
        return s.square()
    if weighting == "eps":
        return (1 - s).square()
    if weighting == "logit_normal":
        c = s.clamp(1e-6, 1 - 1e-6)
        logit = torch.log(c / (1 - c))
        return torch.exp(-0.5 * ((logit - mean) / std) ** 2) / (std * math.sqrt(2 * math.pi) * c * (1 - c))
    if weighting == "min_snr":
        return torch.minimum((1 - s).square(), gamma * s.square())
    raise ValueError(f"unknown weighting {weighting!r}; one of {', '.join(WEIGHTINGS)}")


LOSSES = ("mse", "l1", "huber")


def reference_flow_loss(pred_NC: torch.Tensor, target_NC: torch.Tensor, seg_N: torch.Tensor,
                        weight_B: torch.Tensor, n_tokens: int, loss: str = "mse", delta: float = 1.0
                        ) -> torch.Tensor:
    """The training loss of a micro-batch (``docs/diffusion.md#training-objective``): each
    token's error ``e(pred - target)`` averaged over the channels, weighted by its sample's
    ``weight``, summed and divided by the step's loss-token count ``n_tokens``; float32,
    0-d. ``e``: ``mse`` d^2, ``l1`` |d|, ``huber`` 0.5 d^2 within ``delta``, else
    delta (|d| - 0.5 delta)."""
    d = pred_NC.float() - target_NC.float()
    if loss == "mse":
        e = d.square()
    elif loss == "l1":
        e = d.abs()
    elif loss == "huber":
        e = F.huber_loss(d, torch.zeros_like(d), reduction="none", delta=delta)
    else:
        raise ValueError(f"unknown loss {loss!r}; one of {', '.join(LOSSES)}")
    return (e.mean(dim=-1) * weight_B.float()[seg_N]).sum() / max(1, n_tokens)


OBJECTIVE: dict[str, Callable] = {"flow_loss": reference_flow_loss}
"""The objective's ops and their references: a table of its own (``OpTable(OBJECTIVE)``,
made by the kernel registry as the DiT's is), which the trainer holds beside the model's."""


def flow_loss(pred_NC: torch.Tensor, target_NC: torch.Tensor, seg_N: torch.Tensor,
              sample_weight_B: torch.Tensor, n_tokens_step: int, loss: str = "mse",
              delta: float = 1.0, ops: OpTable | None = None) -> torch.Tensor:
    """This micro-batch's share of the step's per-token mean loss (backward it as is):
    ``ops.flow_loss`` of an objective table (``OBJECTIVE``; its reference without one)."""
    fn = ops.flow_loss if ops is not None else reference_flow_loss
    return fn(pred_NC, target_NC, seg_N, sample_weight_B, n_tokens_step, loss, delta)
