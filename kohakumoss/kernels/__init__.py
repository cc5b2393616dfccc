"""Kernels behind a registry (``docs/engines.md``): per op of the op table, its reference
and backends that declare where they can run; ``build_op_table`` makes one model's table
(static choices, or per shape bucket from a tuning table) and logs the dispatch once. The op
contract (references, ``OpTable``) is ``kohakumoss.model.ops``; the problem shapes are in
``problems``, the tuner in ``tuning``, the table format in ``table``.

Importing the package registers the built-in backends (``compiled``: torch.compile).
"""

from kohakumoss.kernels.dispatch import REFERENCE_NAME, Backend, TunedOp, entry_key
from kohakumoss.kernels.registry import KERNELS, KernelError, KernelRegistry, build_op_table, register_backend
from kohakumoss.kernels import compiled  # noqa: E402,F401  (registers the compile backend)
from kohakumoss.kernels import backends  # noqa: E402,F401  (registers Triton, flash varlen, flex)

__all__ = ["KERNELS", "REFERENCE_NAME", "Backend", "KernelError", "KernelRegistry", "TunedOp",
           "build_op_table", "entry_key", "register_backend"]
