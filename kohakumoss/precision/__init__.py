"""Precision: the dtype-name map, the master/compute dtype policy of training and of
sampling, quantized weights (``kohakumoss.precision.quant``, imported where it is used).

The model never imports this package; engines and loaders apply it from outside.
"""

from kohakumoss.precision.dtypes import DTYPES, dtype_name, resolve_dtype, supports_bf16  # noqa: F401
from kohakumoss.precision.policy import PrecisionPolicy, precision_policy, sampling_policy  # noqa: F401
