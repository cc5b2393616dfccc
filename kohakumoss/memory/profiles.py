"""Memory profiles: the top-level ``profile`` param names a set of memory engines
(``docs/memory.md``). ``manual`` takes them from the ``memory:`` section; ``auto`` is
resolved by the trainer from the estimator (``kohakumoss.training.estimate``): the fastest
engines whose predicted peak fits the memory the device has free. Reading the params is
``kohakumoss.training.autoprofile.profile_engines``'s.

What each profile runs:

=========  ==============================================================================
speed      nothing checkpointed (every activation kept: fastest, most memory); with
           ``precision.fp8_compute: full`` (or fast) the weight codes' transposes kept between steps
balanced   nothing checkpointed, but the norms', RoPE's and SiTU's outputs are not kept:
           backward runs those ops again on their kept inputs (``rebuild``; no matmul runs
           twice)
low        every block keeps only its input (``block`` checkpointing), in host memory with its
           attention output (activation offload: the recomputation skips the attention and
           the block's last linear), the frozen base's block weights streamed through 4
           device slots, the optimizer on the host (gradients offloaded, states and update
           on the CPU)
minimal    ``sub-block`` checkpointing (half a block recomputed at a time) whose kept inputs
           wait in host memory as ``low``'s, weights streamed through 2 slots, the optimizer
           on the host
=========  ==============================================================================

Weight streaming needs a CUDA device and a frozen base, the host update and activation
offload a CUDA device: on the CPU, and for a full finetune, ``low`` and ``minimal`` leave out what cannot apply and
say so (``kohakumoss.training.estimate.placed``).
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
    optimizer: str = "device"  # host: gradients offloaded, the update on the CPU (HostUpdate)
    offload: bool = False  # block checkpointing's kept inputs in host memory (activation offload)
    rebuild: bool = False  # the norms', RoPE's and SiTU's outputs rebuilt in backward, not kept
    resident_blocks: int = 0  # streaming: the first blocks' weights stay on the device (auto fills it)
    fp8_transposes: bool = False  # precision.fp8_compute full: the codes' transposes kept between steps

    def describe(self) -> str:
        what = self.checkpointing + (f" {self.checkpoint_blocks}" if self.checkpointing == "partial" else "")
        streamed = (f", weights streamed through {self.stream_slots} slots"
                    + (f" (the first {self.resident_blocks} blocks resident)" if self.resident_blocks else "")
                    if self.stream_slots else "")
        host = {"host": ", optimizer on the host", "fused": ", the step in backward",
                "streamed": ", optimizer states streamed from the host"}.get(self.optimizer, "")
        offload = ", inputs offloaded to the host" if self.offload else ""
        rebuild = ", elementwise outputs rebuilt" if self.rebuild else ""
        kept = ", fp8 transposes kept" if self.fp8_transposes else ""
        return (f"checkpointing {what}{offload}, recompute {'on' if self.recompute else 'off'}"
                f"{rebuild}{streamed}{host}{kept}")


PROFILE_ENGINES: dict[str, MemoryEngines] = {
    "speed": MemoryEngines("none", fp8_transposes=True),
    "balanced": MemoryEngines("none", rebuild=True),
    "low": MemoryEngines("block", stream_slots=4, optimizer="host", offload=True),
    "minimal": MemoryEngines("sub-block", stream_slots=2, optimizer="host", offload=True),
}
PROFILES_BY_MEMORY = ("speed", "balanced", "low", "minimal")  # the distinct profiles, most memory first (auto sorts by slowdown)


# what each engine adds to the step time of ``speed`` (nothing checkpointed, resident), as
# measured on the H200 (rank-32 LoRA at 1 MP, four samples per step, docs/performance.md):
# recomputing every block's forward +40% (block or sub-block checkpointing), +29% (block)
# and +26% (sub-block) when activation offload replays the attention and skips the tails,
# selective checkpointing +22%, rebuilding the elementwise outputs +6%; streaming, the host
# update and activation offload's copies a little more on top. Only the order matters:
# ``profile: auto`` tries the engines fastest first. The fp8 codes' transposes made each
# backward instead of kept: ~0.5% of an fp8 `full` step (3.3 ms of 675).
RECOMPUTE_ALL, RECOMPUTE_ELEMENTWISE, REBUILD, PER_HOST_ENGINE = 0.40, 0.22, 0.06, 0.01
TRANSPOSED_EACH_STEP = 0.005
RECOMPUTE_REPLAYED = {"block": 0.29, "sub-block": 0.26}


def slowdown(engines: MemoryEngines, depth: int) -> float:
    """The predicted step time of ``engines`` over ``speed``'s, minus one (``RECOMPUTE_ALL``)."""
    mode = engines.checkpointing
    if mode == "partial":
        share = min(engines.checkpoint_blocks, depth) / depth
        cost = RECOMPUTE_ALL * share + REBUILD * (1 - share) * engines.rebuild
    elif engines.offload and mode in RECOMPUTE_REPLAYED:
        cost = RECOMPUTE_REPLAYED[mode]
    else:
        cost = {"none": REBUILD * engines.rebuild, "selective": RECOMPUTE_ELEMENTWISE}.get(mode, RECOMPUTE_ALL)
    host = (engines.stream_slots > 0) + (engines.optimizer == "host") + engines.offload
    # fewer slots wait more often for a block's copy
    return cost + PER_HOST_ENGINE * host + (PER_HOST_ENGINE / engines.stream_slots
                                            if engines.stream_slots else 0) \
        + TRANSPOSED_EACH_STEP * (not engines.fp8_transposes)
