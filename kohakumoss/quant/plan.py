"""The quantization plan of a run: ``precision.base`` and ``precision.fp8_compute`` decoded
once, here, into a frozen ``QuantPlan`` (``docs/precision.md``). Nothing else reads the
``fp8_compute`` knob (``tests/test_contract.py``): training (``engine_plan``), sampling
(``generate``), the params checks, the estimator and the benches all take the plan.

``fp8_compute``:

- ``off``: a quantized base's linears dequantize their codes (weight-only);
- ``on``: fp8 GEMMs forward (an fp8 base, sm89+); the input gradients in bf16;
- ``full``: the input gradients and the LoRA's products in the fp8 GEMMs too;
- ``fast``: ``full`` with those input gradients' GEMMs accumulating fast.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

BASES = ("keep", "int8", "fp8")
FP8_COMPUTE = ("off", "on", "full", "fast")
# the backends a quantized base's linears take when no choice names them, each where it
# fits (they are not tuned: both keep only the codes, which the reference does not)
DEFAULT_BACKENDS: Mapping[str, tuple[str, ...]] = {
    "quant_linear": ("dequant_mm", "triton"), "fp8_linear": ("scaled_mm",),
    "fp8_lora_linears": ("scaled_mm",)}
# with fast accumulation in the input gradients' GEMMs (fp8_compute: fast)
FAST_GRAD_BACKENDS: Mapping[str, tuple[str, ...]] = {
    "fp8_linear": ("scaled_mm_fast",), "fp8_lora_linears": ("scaled_mm_fast",)}


@dataclasses.dataclass(frozen=True)
class QuantPlan:
    """How the frozen base's block linears are held and multiplied."""

    base: str = "keep"  # keep (the policy's weight dtype) | int8 | fp8
    compute: bool = False  # fp8 GEMMs (an fp8 base, sm89+)
    grad: bool = False  # their input gradients and the LoRA's products in fp8 GEMMs too
    fast_grad: bool = False  # those input gradients' GEMMs accumulating fast

    def __post_init__(self):
        if self.base not in BASES:
            raise ValueError(f"precision.base {self.base!r}: one of {', '.join(BASES)}")

    @property
    def knob(self) -> str:
        """The ``precision.fp8_compute`` value this plan decodes."""
        return ("fast" if self.fast_grad else "full") if self.grad else "on" if self.compute else "off"

    @property
    def quantized(self) -> bool:
        return self.base != "keep"

    @property
    def keeps_transposes(self) -> bool:
        """Whether the fp8 input gradients' transposed codes can be kept between steps."""
        return self.grad

    def policy_args(self) -> dict[str, object]:
        """``precision_policy``'s arguments for this plan."""
        return {"base": self.base, "fp8_compute": self.compute, "fp8_grad": self.grad,
                "fp8_fast_grad": self.fast_grad}

    def backends(self) -> dict[str, list[str]]:
        """The quantized ops' backends, where no choice names theirs."""
        chosen = {**DEFAULT_BACKENDS, **(FAST_GRAD_BACKENDS if self.fast_grad else {})}
        return {op: list(b) for op, b in chosen.items()}


def decode(base: str, fp8_compute: str) -> QuantPlan:
    """The plan of ``precision.base`` = ``base`` and ``precision.fp8_compute`` = ``fp8_compute``."""
    if fp8_compute not in FP8_COMPUTE:
        raise ValueError(f"precision.fp8_compute {fp8_compute!r}: one of {', '.join(FP8_COMPUTE)}")
    grad = fp8_compute in ("full", "fast")
    return QuantPlan(base=base, compute=fp8_compute != "off", grad=grad, fast_grad=fp8_compute == "fast")


def quant_plan(precision) -> QuantPlan:
    """The plan of a params ``precision`` section (``PrecisionConfig``)."""
    return decode(precision.base, precision.fp8_compute)


def of_policy(policy) -> QuantPlan:
    """The plan a ``PrecisionPolicy`` holds (its base and fp8 flags)."""
    return QuantPlan(base=policy.base, compute=policy.fp8_compute, grad=policy.fp8_grad,
                     fast_grad=policy.fp8_fast_grad)
