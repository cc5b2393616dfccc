"""The inference sigma schedule (``docs/diffusion.md#inference-sigma-schedule``): shifted
linspace, snapped to the float32 training grid (``linspace(1, 1/T, T)``, ties to the smaller
value), consecutive duplicates dropped, a final 0 appended."""

from __future__ import annotations

import torch

from kohakumoss.diffusion.timesteps import shift_sigma


def inference_sigmas(steps: int = 50, shift: float = 5.0, grid: int = 1000) -> torch.Tensor:
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    lower = shift / (grid + shift - 1)
    sig = shift_sigma(torch.linspace(1, lower, steps, dtype=torch.float32), shift)
    ascending = torch.linspace(1, 1 / grid, grid, dtype=torch.float32).flip(0)
    snapped = ascending[(ascending[None, :] - sig[:, None]).abs().argmin(dim=1)]  # first = smaller
    keep = torch.ones_like(snapped, dtype=torch.bool)
    keep[1:] = snapped[1:] != snapped[:-1]
    return torch.cat([snapped[keep], torch.zeros(1)])
