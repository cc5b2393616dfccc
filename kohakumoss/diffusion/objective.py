"""The rectified-flow objective on packed image tokens (``docs/diffusion.md#training-objective``).

Legend: N image tokens of a micro-batch, C = 128 channels, B samples, ``seg`` [N] the
sample of each token. ``z = (1 - s) x0 + s eps``, target ``eps - x0``; the per-token error
(mean over channels) is weighted per sample (dataset loss weight x sigma weighting),
summed, and divided by the loss-token count of the whole optimiser step (all
micro-batches, all ranks), so the loss is a per-token mean however the step is split.
"""

from __future__ import annotations

import torch

from kohakumoss.model.ops import REFERENCE, OpTable


def noised(x0_NC: torch.Tensor, eps_NC: torch.Tensor, sigma_N: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(z_sigma, target) in float32."""
    x0, eps, s = x0_NC.float(), eps_NC.float(), sigma_N.float()[:, None]
    return x0 + s * (eps - x0), eps - x0




def sigma_weight(sigma_B: torch.Tensor, weighting: str = "none") -> torch.Tensor:
    s = sigma_B.float()
    if weighting == "none":
        return torch.ones_like(s)
    if weighting == "x0":
        return s.square()
    if weighting == "eps":
        return (1 - s).square()
    raise ValueError(f"unknown weighting {weighting!r}; one of none, x0, eps")


def flow_loss(pred_NC: torch.Tensor, target_NC: torch.Tensor, seg_N: torch.Tensor,
              sample_weight_B: torch.Tensor, n_tokens_step: int, loss: str = "mse",
              delta: float = 1.0, ops: OpTable | None = None) -> torch.Tensor:
    """This micro-batch's share of the step's per-token mean loss (backward it as is):
    ``ops.flow_loss`` of the model's op table (its reference without one)."""
    fn = ops.flow_loss if ops is not None else REFERENCE["flow_loss"]
    return fn(pred_NC, target_NC, seg_N, sample_weight_B, n_tokens_step, loss, delta)
