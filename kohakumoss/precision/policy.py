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
    base: str = "keep"  # the frozen base's block linears: keep (``weights``) | int8 | fp8
    fp8_compute: bool = False  # those linears as fp8 GEMMs (base fp8, sm89+)
    fp8_grad: bool = False  # their input gradients and LoRA products in the fp8 GEMMs too (fp8_compute: full)
    fp8_fast_grad: bool = False  # those input gradients' GEMMs accumulating fast (fp8_compute: fast)

    def autocast(self, device: torch.device | str) -> contextlib.AbstractContextManager:
        """The context a training forward runs in on ``device``."""
        if self.compute == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(device).type, dtype=self.compute)

    def describe(self) -> dict[str, str]:
        out = {"compute": dtype_name(self.compute), "weights": dtype_name(self.weights)}
        if self.stream_scale != 1.0:
            out["stream_scale"] = f"{self.stream_scale:g}"
        if self.base != "keep":
            grads = ", input gradients too" + (", fast accumulation" if self.fp8_fast_grad else "")
            out["base"] = self.base + ((f" (fp8 compute{grads if self.fp8_grad else ''})")
                                       if self.fp8_compute else " weight-only")
        return out

    def check_device(self, device: torch.device) -> None:
        """fp8 compute needs fp8 tensor cores: CUDA compute capability 8.9 or more."""
        if not self.fp8_compute:
            return
        cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        if cap is None or cap < (8, 9):
            where = f"{torch.cuda.get_device_name(device)} (sm{cap[0]}{cap[1]})" if cap else str(device)
            knob = ("fast" if self.fp8_fast_grad else "full") if self.fp8_grad else "on"
            raise ValueError(f"precision.fp8_compute: {knob} needs fp8 tensor cores (CUDA compute "
                             f"capability 8.9+: Ada, Hopper, Blackwell); this run is on {where}. "
                             f"Set precision.fp8_compute: off (precision.base: fp8 still halves "
                             f"the base's memory)")


def precision_policy(dtype: str, full: bool, stream_scale: float = 1.0, base: str = "keep",
                     fp8_compute: bool = False, fp8_grad: bool = False,
                     fp8_fast_grad: bool = False) -> PrecisionPolicy:
    """The policy for ``train.dtype`` = ``dtype`` (a plan name: bf16 / fp16 / fp32) and a
    full finetune (``full``, from ``adapter.full``) or an adapter run; ``stream_scale``:
    ``kohakumoss.precision.scaler.stream_scale``'s for the params; ``base`` and
    ``fp8_compute`` / ``fp8_grad`` / ``fp8_fast_grad``: the run's quantization plan's
    (``kohakumoss.quant.QuantPlan.policy_args``; ``kohakumoss.quant.linear``)."""
    if dtype not in DTYPES:
        raise ValueError(f"train dtype {dtype!r} is not one of {', '.join(DTYPES)}; set "
                         f"train.dtype to one of them")
    compute = DTYPES[dtype]
    return PrecisionPolicy(compute=compute, weights=torch.float32 if full else compute,
                           stream_scale=stream_scale, base=base, fp8_compute=fp8_compute,
                           fp8_grad=fp8_compute and fp8_grad,
                           fp8_fast_grad=fp8_compute and fp8_grad and fp8_fast_grad)


def sampling_policy(dtype: torch.dtype, precision, base: str = "keep",
                    fp8_compute: bool = False) -> PrecisionPolicy:
    """Sampling (``kmoss sample`` / ``grid``): weights held and computed in ``dtype``, the
    joint stream carried at the ``precision`` section's scale (2^-8 under fp16, so an fp16
    sample does not overflow where an fp16 training step would not), the base held as the
    run's quantization plan says (``base``, ``fp8_compute``: ``kohakumoss.quant``'s, as
    training holds it; a forward has no input gradients)."""
    from kohakumoss.precision.scaler import stream_scale

    return PrecisionPolicy(compute=dtype, weights=dtype, stream_scale=stream_scale(precision, dtype),
                           base=base, fp8_compute=fp8_compute)
