"""Kernels behind a registry (``docs/engines.md``): per op of an op table (the DiT's,
``kohakumoss.model.ops``; the objective's, ``kohakumoss.diffusion.objective``; the quantized
base's, registered by ``kohakumoss.quant``), its reference and backends that declare where
they can run; ``build_op_table`` makes one table (static choices, or per shape bucket from a
tuning table) and logs the dispatch once. Here: the registry (``registry``), the dispatch
(``dispatch``), problem shapes (``problems``), the tuner (``tuning``) and the table format
(``table``); and one folder per op holding its backends and its problem shapes (``norm/``,
``rope/``, ``pointwise/``, ``attention/``, ``loss/``, ``linear/``), each registering itself
when imported, as this package does.
"""

from kohakumoss.kernels.dispatch import REFERENCE_NAME, Backend, TunedOp, entry_key
from kohakumoss.kernels.registry import KERNELS, KernelError, KernelRegistry, build_op_table, register_backend
from kohakumoss.kernels import compiled  # noqa: E402,F401  (the compile backend of the elementwise ops)
from kohakumoss.kernels import norm, rope, pointwise, attention, loss, linear  # noqa: E402,F401

__all__ = ["KERNELS", "REFERENCE_NAME", "Backend", "KernelError", "KernelRegistry", "TunedOp",
           "build_op_table", "entry_key", "register_backend"]
