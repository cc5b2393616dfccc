"""Memory engines, applied to a built model from outside (``docs/engines.md``): recomputation
of the elementwise ops (on the model's own op table) and per-block activation checkpointing
(on the repeated blocks the model declares). Both keep outputs and gradients bit-identical.
"""

from kohakumoss.memory.checkpointing import apply_block_checkpointing, repeated_blocks
from kohakumoss.memory.recompute import ELEMENTWISE, apply_recompute, recomputed

__all__ = ["ELEMENTWISE", "apply_block_checkpointing", "apply_recompute", "recomputed",
           "repeated_blocks"]
