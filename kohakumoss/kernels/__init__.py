"""Kernels behind a registry (``docs/engines.md``): per op of the op table, its reference
and backends that declare when they can run; ``build_op_table`` makes one model's table and
logs the dispatch once. The op contract (references, ``OpTable``) is ``kohakumoss.model.ops``.
"""

from kohakumoss.kernels.registry import (KERNELS, REFERENCE_NAME, Backend, KernelError,
                                         KernelRegistry, build_op_table, register_backend)

__all__ = ["KERNELS", "REFERENCE_NAME", "Backend", "KernelError", "KernelRegistry",
           "build_op_table", "register_backend"]
