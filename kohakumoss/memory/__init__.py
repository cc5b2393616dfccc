"""Memory engines, applied to a built model from outside (``docs/engines.md``): recomputation
of the elementwise ops (on the model's own op table) and activation checkpointing in several
modes (on the repeated blocks and halves the model declares). All keep outputs and gradients
bit-identical.
"""

from kohakumoss.memory.checkpointing import (MODES, apply_block_checkpointing, apply_checkpointing,
                                             repeated_blocks)
from kohakumoss.memory.recompute import ELEMENTWISE, apply_recompute, recomputed

__all__ = ["ELEMENTWISE", "MODES", "apply_block_checkpointing", "apply_checkpointing",
           "apply_recompute", "recomputed", "repeated_blocks"]
