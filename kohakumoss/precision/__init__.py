"""Precision: the dtype-name map, the master/compute dtype policy, quantized weights.

The model never imports this package; engines and loaders apply it from outside.
"""

from kohakumoss.precision.dtypes import DTYPES, dtype_name, resolve_dtype, supports_bf16  # noqa: F401
