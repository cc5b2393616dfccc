"""Memory profiles: the top-level ``profile`` param names a set of memory engines
(``docs/memory.md``). ``manual`` takes them from the ``memory:`` section; ``auto`` is
resolved by the trainer from the estimator (``kohakumoss.training.estimate``): the fastest
engines whose predicted peak fits the memory the device has free. Reading the params is
``kohakumoss.training.estimate.profile_engines``'s.

What each profile runs today (the engines of the memory issue that are built: activation
checkpointing and recomputation; weight streaming, activation offload and host optimizer
states are not, so ``low`` and ``minimal`` run ``balanced``'s engines for now):

=========  ==============================================================================
speed      nothing checkpointed (every activation kept: fastest, most memory)
balanced   every block keeps only its input (``block`` checkpointing)
low        as balanced
minimal    as balanced
=========  ==============================================================================
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MemoryEngines:
    """The memory engines a run applies (``kohakumoss.training.engines.apply_engines``)."""

    checkpointing: str = "none"  # kohakumoss.memory.checkpointing.MODES
    checkpoint_blocks: int = 0  # partial: blocks of each list checkpointed, from the first
    recompute: bool = True  # the elementwise references' fp32 intermediates, recomputed

    def describe(self) -> str:
        what = self.checkpointing + (f" {self.checkpoint_blocks}" if self.checkpointing == "partial" else "")
        return f"checkpointing {what}, recompute {'on' if self.recompute else 'off'}"


PROFILE_ENGINES: dict[str, MemoryEngines] = {
    "speed": MemoryEngines("none"),
    "balanced": MemoryEngines("block"),
    "low": MemoryEngines("block"),
    "minimal": MemoryEngines("block"),
}
FASTEST_FIRST = ("speed", "balanced")  # the distinct profiles, fastest first (auto's order)
