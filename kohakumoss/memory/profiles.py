"""Memory profiles: the top-level ``profile`` param names a set of memory engines
(``docs/memory.md``). ``manual`` takes them from the ``memory:`` section; ``auto`` is
resolved by the trainer from the estimator (``kohakumoss.training.estimate``): the fastest
engines whose predicted peak fits the memory the device has free. Reading the params is
``kohakumoss.training.estimate.profile_engines``'s.

What each profile runs today (activation offload and host optimizer states are not built
yet: ``low`` and ``minimal`` differ in how many blocks of weights the device holds):

=========  ==============================================================================
speed      nothing checkpointed (every activation kept: fastest, most memory)
balanced   every block keeps only its input (``block`` checkpointing)
low        as balanced, the frozen base's block weights streamed through 4 device slots
minimal    as balanced, streamed through 2 slots
=========  ==============================================================================

Weight streaming needs a CUDA device and a frozen base: on the CPU, and for a full
finetune, ``low`` and ``minimal`` keep the weights resident and say so
(``kohakumoss.training.estimate.placed``).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MemoryEngines:
    """The memory engines a run applies (``kohakumoss.training.engines.apply_engines``)."""

    checkpointing: str = "none"  # kohakumoss.memory.checkpointing.MODES
    checkpoint_blocks: int = 0  # partial: blocks of each list checkpointed, from the first
    recompute: bool = True  # the elementwise references' fp32 intermediates, recomputed
    stream_slots: int = 0  # the frozen base's block weights streamed through this many slots; 0: resident

    def describe(self) -> str:
        what = self.checkpointing + (f" {self.checkpoint_blocks}" if self.checkpointing == "partial" else "")
        streamed = f", weights streamed through {self.stream_slots} slots" if self.stream_slots else ""
        return f"checkpointing {what}, recompute {'on' if self.recompute else 'off'}{streamed}"


PROFILE_ENGINES: dict[str, MemoryEngines] = {
    "speed": MemoryEngines("none"),
    "balanced": MemoryEngines("block"),
    "low": MemoryEngines("block", stream_slots=4),
    "minimal": MemoryEngines("block", stream_slots=2),
}
FASTEST_FIRST = ("speed", "balanced", "low", "minimal")  # the distinct profiles, fastest first (auto's order)
