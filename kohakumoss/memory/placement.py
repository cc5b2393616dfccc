"""Where the memory engines place things: a CUDA device with its index."""

from __future__ import annotations

import torch


def indexed(device: torch.device | str) -> torch.device:
    """``device`` with the index a tensor's ``.device`` carries (a bare ``cuda`` is the
    current device), so comparisons, streams and other threads name the same card."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
