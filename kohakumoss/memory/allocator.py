"""The CUDA caching allocator's settings for tight profiles (``docs/memory.md, "The allocator"``).

Streamed and offloaded steps allocate buffers of many sizes (weight slots, each part's
input on its way to the host, per-sample activations) and free them out of order, on side
streams. With fixed-size segments the allocator's reserve then runs far above what is
allocated: `low` with four samples allocated 4.48 GiB at its peak but reserved 6.82 GiB,
and ran out of memory under a 6 GiB cap. Expandable segments (one growing mapping per
stream) reserved 5.91 GiB for the same step, which then fit (H200, docs/performance.md).
"""

from __future__ import annotations

import logging
import os

import torch

from kohakumoss.memory.profiles import MemoryEngines

log = logging.getLogger(__name__)

SETTING = "expandable_segments:True"


def tight_allocator(engines: MemoryEngines, device: torch.device) -> bool:
    """Expandable segments for a CUDA run whose engines stream weights or offload
    activations, unless ``PYTORCH_CUDA_ALLOC_CONF`` is set (the user's choice stands). True
    when the setting was made. Call it before the model comes to the device: segments
    already made stay as they are."""
    if device.type != "cuda" or not (engines.stream_slots or engines.offload):
        return False
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        log.info("allocator: PYTORCH_CUDA_ALLOC_CONF=%s as set (this profile would take %s)",
                 os.environ["PYTORCH_CUDA_ALLOC_CONF"], SETTING)
        return False
    apply_setting(SETTING)
    log.info("allocator: %s (streamed and offloaded buffers fragment fixed segments; set "
             "PYTORCH_CUDA_ALLOC_CONF to choose otherwise)", SETTING)
    return True


def apply_setting(setting: str) -> None:
    """Give the caching allocator ``setting`` (``PYTORCH_CUDA_ALLOC_CONF``'s syntax) through
    torch's accelerator call (torch >= 2.11); ``torch.cuda.memory._set_allocator_settings``,
    which wraps it, warns of its removal."""
    torch._C._accelerator_setAllocatorSettings(setting)
