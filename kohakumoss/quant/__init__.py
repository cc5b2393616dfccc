"""Quantized bases and fp8 compute: the plan decoded once from ``precision.*``
(``quant.plan``), which training, sampling, the estimator and the benches read."""

from kohakumoss.quant.plan import FP8_COMPUTE, QuantPlan, quant_plan  # noqa: F401
