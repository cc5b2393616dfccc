"""Device names in params: ``auto``, ``cpu``, ``cuda``, ``cuda:N``."""

from __future__ import annotations

import torch


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    if isinstance(name, torch.device):
        return name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu" or name == "cuda" or name.startswith("cuda:"):
        if name != "cpu" and not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: CUDA is not available here; use 'cpu' or 'auto'")
        return torch.device(name)
    raise ValueError(f"device {name!r} is not one of auto, cpu, cuda, cuda:N")


def indexed(device: torch.device | str) -> torch.device:
    """``device`` with the index a tensor's ``.device`` carries (a bare ``cuda`` is the
    current device), so comparisons, streams and other threads name the same card."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
