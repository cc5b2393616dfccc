"""The training precision policy: which dtype the model's weights are held in, which dtype
the forward computes in, and the autocast that gets it there (``docs/training.md``).

* Full finetune: the weights are the fp32 master copy the optimiser steps; the forward
  computes under autocast in ``train.dtype``.
* Adapters: the frozen base is held in ``train.dtype`` (half the memory of fp32); the
  adapter's own parameters stay fp32 (the adapters package takes ``max(fp32, base dtype)``)
  and the forward runs under the same autocast.

In both, autocast is off when ``train.dtype`` is fp32. The modules the model keeps in
``max(fp32, dtype)`` (its ``FP32_MODULES``) are the cast's business, not the policy's.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from kohakumoss.precision.dtypes import DTYPES, dtype_name


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    compute: torch.dtype  # what the forward computes in (``train.dtype``)
    weights: torch.dtype  # what the model's weights are held in (and loaded in)
    stream_scale: float = 1.0  # the joint residual stream carried times this (fp16's range)

    def autocast(self, device: torch.device | str) -> contextlib.AbstractContextManager:
        """The context a training forward runs in on ``device``."""
        if self.compute == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(device).type, dtype=self.compute)

    def describe(self) -> dict[str, str]:
        out = {"compute": dtype_name(self.compute), "weights": dtype_name(self.weights)}
        if self.stream_scale != 1.0:
            out["stream_scale"] = f"{self.stream_scale:g}"
        return out


def precision_policy(dtype: str, full: bool, stream_scale: float = 1.0) -> PrecisionPolicy:
    """The policy for ``train.dtype`` = ``dtype`` (a plan name: bf16 / fp16 / fp32) and a
    full finetune (``full``, from ``adapter.full``) or an adapter run; ``stream_scale``:
    ``kohakumoss.precision.scaler.stream_scale``'s for the params."""
    if dtype not in DTYPES:
        raise ValueError(f"train dtype {dtype!r} is not one of {', '.join(DTYPES)}; set "
                         f"train.dtype to one of them")
    compute = DTYPES[dtype]
    return PrecisionPolicy(compute=compute, weights=torch.float32 if full else compute,
                           stream_scale=stream_scale)


def sampling_policy(dtype: torch.dtype, precision) -> PrecisionPolicy:
    """Sampling (``kmoss sample`` / ``grid``): weights held and computed in ``dtype``, the
    joint stream carried at the ``precision`` section's scale (2^-8 under fp16, so an fp16
    sample does not overflow where an fp16 training step would not)."""
    from kohakumoss.precision.scaler import stream_scale

    return PrecisionPolicy(compute=dtype, weights=dtype, stream_scale=stream_scale(precision, dtype))
