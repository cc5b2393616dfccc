"""Trained norms: a zero-initialised delta ``w_norm`` on one RMSNorm weight.

The effective weight is ``weight + m * w_norm``. The norm module's class is swapped for a
subclass whose ``weight`` attribute is computed, so the op table reads the effective weight
while the parameter itself (and the model's state-dict key) stays untouched.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

KEY = "_kmoss_norm_delta"


@functools.cache
def _with_delta(cls: type) -> type:
    def __getattr__(self, name):
        delta = self.__dict__.get(KEY)
        if name == "weight" and delta is not None:
            w = self._parameters["weight"]
            return w + (delta.multiplier * delta.w_norm).to(w.dtype)
        return cls.__getattr__(self, name)

    return type(cls.__name__, (cls,), {"__getattr__": __getattr__, "_kmoss_base_class": cls})


class NormDelta(nn.Module):
    """``<lora_name>.w_norm`` for the norm at one path; ``attach``/``detach`` switch it on/off."""

    def __init__(self, lora_name: str, norm: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.lora_name = lora_name
        self.target = [norm]  # a list, so the norm is not a submodule of the delta
        weight = norm._parameters["weight"]
        self.w_norm = nn.Parameter(torch.zeros(weight.shape, dtype=dtype, device=weight.device))
        self.multiplier = 1.0

    @property
    def norm_weight(self) -> torch.Tensor:
        return self.target[0]._parameters["weight"]

    def attach(self) -> None:
        norm = self.target[0]
        if KEY not in norm.__dict__:
            norm.__class__ = _with_delta(type(norm))
        norm.__dict__[KEY] = self

    def detach(self) -> None:
        norm = self.target[0]
        if norm.__dict__.pop(KEY, None) is not None:
            norm.__class__ = type(norm)._kmoss_base_class

    @torch.no_grad()
    def merged_weight(self, multiplier: float) -> torch.Tensor:
        w = self.norm_weight
        dt = torch.promote_types(w.dtype, torch.float32)
        return w.to(dt) + multiplier * self.w_norm.to(dt)
