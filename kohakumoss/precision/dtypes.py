"""Dtype names of params.yaml and the torch dtypes they stand for (the one map).

Plan names: ``"bf16" | "fp16" | "fp32"`` plus ``"auto"``. ``resolve_dtype`` turns ``auto``
into bf16 where the device computes in bf16 (the host CPU counts as one), else fp16; an
encoder whose CPU default differs (the VAE: fp32, ``docs/encoders.md#vae-dtype-and-batching``) passes
``cpu_auto``. Each encoder passes the names it accepts as ``allowed``.
"""

from __future__ import annotations

import torch

from kohakumoss.device import resolve_device

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def supports_bf16(device: torch.device) -> bool:
    """bf16 compute: the CPU yes, CUDA from compute capability 8.0 (Ampere) on."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return True


def resolve_dtype(name: str, device: str | torch.device, allowed=tuple(DTYPES),
                  cpu_auto: str = "bf16") -> torch.dtype:
    """The torch dtype for a plan name; ``auto`` resolved for ``device``."""
    if name == "auto":
        dev = resolve_device(device)
        name = cpu_auto if dev.type == "cpu" else ("bf16" if supports_bf16(dev) else "fp16")
    if name not in allowed or name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not accepted here; use auto or one of "
                         f"{', '.join(allowed)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"{dtype} has no plan name (expected one of {', '.join(DTYPES)})")
