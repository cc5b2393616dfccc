"""Dynamic loss scaling for fp16 training (``docs/precision.md``).

fp16 holds 5 bits of exponent: gradients of a flow loss fall below its smallest normal
(6e-5) and flush to zero. The loss is multiplied by ``scale`` before backward, the gradients
divided by it after (on the fp32 masters the optimizer steps). A step whose gradients
overflowed (a non-finite norm) is skipped and the scale halves; after ``growth_interval``
finite steps in a row it doubles. The scale and its counter are part of the checkpoint, so a
resumed run scales as the uninterrupted one did.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class LossScaler:
    """``scale`` the loss, ``unscale`` the gradients, ``update`` with whether they were finite."""

    def __init__(self, init_scale: float = 65536.0, growth_interval: int = 2000,
                 growth: float = 2.0, backoff: float = 0.5, min_scale: float = 2.0 ** -14):
        self.scale = float(init_scale)
        self.growth_interval, self.growth, self.backoff = growth_interval, growth, backoff
        self.min_scale = min_scale
        self.good = 0  # finite steps since the last change
        self.skipped = 0  # steps skipped for overflow, in all

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale(self, tensors: Iterable[torch.Tensor]) -> None:
        """Divide every gradient by the scale, in place (before clipping and the finite check)."""
        inv = 1.0 / self.scale
        for t in tensors:
            if t.grad is not None:
                t.grad.mul_(inv)

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale = max(self.min_scale, self.scale * self.backoff)
            self.good = 0
            self.skipped += 1
            return
        self.good += 1
        if self.good >= self.growth_interval:
            self.scale *= self.growth
            self.good = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good": self.good, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good, self.skipped = float(state["scale"]), int(state["good"]), int(state["skipped"])


def loss_scaler(precision, compute: torch.dtype) -> LossScaler | None:
    """The run's scaler: ``precision.loss_scale`` auto scales fp16 only."""
    on = precision.loss_scale == "dynamic" or (precision.loss_scale == "auto" and compute == torch.float16)
    return LossScaler(precision.init_scale, precision.growth_interval) if on else None


def stream_scale(precision, compute: torch.dtype) -> float:
    """The factor the joint residual stream is carried at: auto is 2^-8 under fp16 (the 42
    blocks' sum overflows fp16's 65504 on real activations), 1 otherwise."""
    if precision.stream_scale is not None:
        return float(precision.stream_scale)
    return 2.0 ** -8 if compute == torch.float16 else 1.0
