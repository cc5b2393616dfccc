"""Memory engines, applied to a built model from outside (``docs/memory.md``): recomputation
of the elementwise ops (on the model's own op table), activation checkpointing in several
modes (on the repeated blocks and halves the model declares), activation offload (the
checkpointed inputs in host memory), weight streaming (block weights in host memory behind a
ring of device slots), the host update (gradients offloaded, the optimizer on host
masters), the step in backward and streamed optimizer states. All keep outputs and
gradients bit-identical.
"""

from kohakumoss.memory.checkpointing import (MODES, apply_block_checkpointing, apply_checkpointing,
                                             repeated_blocks)
from kohakumoss.memory.host_update import HostUpdate
from kohakumoss.memory.offload import apply_activation_offload
from kohakumoss.memory.recompute import ELEMENTWISE, apply_recompute, recomputed
from kohakumoss.memory.stepping import FusedStep, StreamedStates
from kohakumoss.memory.streaming import apply_weight_streaming

__all__ = ["ELEMENTWISE", "MODES", "FusedStep", "HostUpdate", "StreamedStates",
           "apply_activation_offload", "apply_block_checkpointing", "apply_checkpointing", "apply_recompute",
           "apply_weight_streaming", "recomputed", "repeated_blocks"]
