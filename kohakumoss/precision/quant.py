"""ComfyUI's quantized weight formats: read (dequantize) and write (for tests and exports).

``docs/checkpoint-layouts.md#quantized-comfyui-files``. Per quantized linear ``<n>``: ``<n>.weight`` holds int8 or fp8
codes, ``<n>.weight_scale`` (legacy ``<n>.scale_weight``) the scale, ``<n>.comfy_quant``
the UTF-8 JSON of the layer format. INT8 ConvRot rotates each group of ``g`` input columns
by a normalised regular Hadamard matrix H (symmetric, H @ H = I) before per-row int8
quantization; dequantization applies the same rotation again. Older fp8 files carry a
``scaled_fp8`` marker key instead of ``comfy_quant``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from functools import lru_cache

import torch

SCALE_NAMES = ("weight_scale", "scale_weight")
SIDE_KEYS = ("comfy_quant", "weight_scale", "scale_weight", "input_scale", "scale_input")
QUANT_DTYPES = {"I8", "F8_E4M3", "F8_E5M2"}  # safetensors dtypes of stored codes
FP8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


@dataclasses.dataclass
class QuantizedWeight:
    """A quantized linear weight as stored: codes, scale and the layer format."""

    codes: torch.Tensor
    scale: torch.Tensor
    format: str
    convrot_group: int = 0

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = self.codes.to(torch.float32)
        s = self.scale.to(torch.float32)
        w = w * (s.reshape(-1, 1) if s.numel() == w.shape[0] and s.numel() > 1 else s.reshape(()))
        if self.convrot_group:
            w = rotate_groups(w, self.convrot_group)
        return w.to(dtype)


@lru_cache(maxsize=8)
def hadamard(g: int) -> torch.Tensor:
    """The normalised regular Hadamard matrix of size g (a power of 4), float32."""
    k = round(math.log(g, 4))
    if 4 ** k != g:
        raise ValueError(f"convrot group size {g} is not a power of 4")
    h4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]],
                      dtype=torch.float64)
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(k):
        h = torch.kron(h, h4)
    return (h / math.sqrt(g)).float()


def rotate_groups(w: torch.Tensor, g: int) -> torch.Tensor:
    """``W[:, group] @ H^T`` for each consecutive group of ``g`` input columns."""
    out_f, in_f = w.shape
    if in_f % g:
        raise ValueError(f"in_features {in_f} is not divisible by the convrot group {g}")
    h = hadamard(g).to(w.device)
    return (w.reshape(out_f, in_f // g, g) @ h.T).reshape(out_f, in_f)


def parse_format(raw: torch.Tensor | None) -> dict:
    if raw is None:
        return {}
    spec = json.loads(bytes(raw.to(torch.uint8).tolist()).decode("utf-8"))
    return {**spec, **spec.get("params", {})}


def quantized_weight(codes: torch.Tensor, scale: torch.Tensor, fmt: dict, where: str) -> QuantizedWeight:
    name = fmt.get("format") or ("int8_tensorwise" if codes.dtype == torch.int8 else
                                 "float8_e4m3fn" if codes.dtype == torch.float8_e4m3fn else
                                 "float8_e5m2" if codes.dtype == torch.float8_e5m2 else "")
    if name not in ("int8_tensorwise", *FP8):
        raise ValueError(f"{where}: quantization format {name!r} is not supported (int8_tensorwise "
                         f"with or without convrot, float8_e4m3fn, float8_e5m2); dequantize the "
                         f"file in ComfyUI or use the bf16 checkpoint")
    group = int(fmt.get("convrot_groupsize", 256)) if fmt.get("convrot") else 0
    return QuantizedWeight(codes, scale, name, group)


def quantize_int8(w: torch.Tensor, convrot_group: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Per-row int8 (optionally ConvRot): codes int8 [out, in], scale f32 [out, 1], format."""
    w = w.float()
    if convrot_group:
        w = rotate_groups(w, convrot_group)
    s = (w.abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-30)
    q = torch.round(w / s).clamp(-128, 127).to(torch.int8)
    fmt = {"format": "int8_tensorwise"}
    if convrot_group:
        fmt.update(convrot=True, convrot_groupsize=convrot_group)
    return q, s, fmt


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Tensor-wise e4m3: scale = amax / 448, codes = (w / scale) in float8_e4m3fn."""
    w = w.float()
    s = (w.abs().amax().clamp_min(1e-12) / 448).reshape(())
    return (w / s).clamp(-448, 448).to(torch.float8_e4m3fn), s, {"format": "float8_e4m3fn"}


def encode_format(fmt: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(fmt).encode("utf-8")), dtype=torch.uint8)
