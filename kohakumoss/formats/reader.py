"""Find a transformer checkpoint on disk and read it tensor by tensor under official names.

Layouts (``docs/formats.md``): a pipeline root or its ``transformer/`` folder
(sharded safetensors with an index, or one file) and a ComfyUI single file (bare keys or a
``model.diffusion_model.`` / ``diffusion_model.`` / ``transformer.`` prefix, fused joint
``proj.qkv``, optionally int8 / int8-ConvRot / fp8 quantized). ``TransformerReader`` hides
all of that: it lists official names with their shapes and returns each tensor dequantized,
memory-mapped from the file, one at a time, so loading never holds two copies of the model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kohakumoss.errors import KohakuError
from kohakumoss.formats.keys import ROPE_KEY, common_prefix, fused_layer, qkv_parts
from kohakumoss.precision.quant import (QUANT_DTYPES, SCALE_NAMES, SIDE_KEYS, QuantizedWeight,
                                       parse_format, quantized_weight)

INDEX = "diffusion_pytorch_model.safetensors.index.json"


def _fused(key: str) -> int | None:
    """N for the fused ``layers.N.proj.qkv.weight`` (not its quantization side tensors)."""
    return fused_layer(key) if key.endswith(".weight") else None


class CheckpointError(KohakuError, ValueError):
    """A path that holds no recognisable MOSS-Image transformer; says what was expected."""


@dataclasses.dataclass
class CheckpointFiles:
    path: Path
    layout: str  # "folder" | "file"
    files: list[Path]
    hf_config: dict | None


def locate(path: str | Path) -> CheckpointFiles:
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"model path {p} does not exist")
    if p.is_file():
        if p.suffix != ".safetensors":
            raise CheckpointError(f"{p} is not a .safetensors file; give a MOSS-Image pipeline "
                                  f"folder, its transformer/ folder, or a ComfyUI .safetensors file")
        return CheckpointFiles(p, "file", [p], None)
    folder = p / "transformer" if (p / "transformer").is_dir() else p
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else None
    index = folder / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [folder / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shards that are missing: {', '.join(missing[:3])}; "
                                  f"the download is incomplete")
        return CheckpointFiles(p, "folder", files, config)
    found = sorted(folder.glob("*.safetensors"))
    if len(found) != 1:
        what = "no .safetensors file" if not found else f"{len(found)} .safetensors files and no {INDEX}"
        raise CheckpointError(f"{folder} holds {what}; expected a MOSS-Image pipeline folder "
                              f"(with transformer/), a transformer folder, or one .safetensors file")
    return CheckpointFiles(p, "folder", found, config)


class TransformerReader:
    """Official-named, dequantized, tensor-at-a-time view over a checkpoint's files."""

    def __init__(self, files: CheckpointFiles):
        self.files = files
        self._handles = []
        for f in files.files:
            try:
                self._handles.append(safe_open(str(f), framework="pt"))
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{f} is not a readable safetensors file ({e}); expected a "
                                      f"MOSS-Image transformer checkpoint") from None
        self._where: dict[str, int] = {}
        for i, h in enumerate(self._handles):
            for k in h.keys():
                self._where[k] = i
        self.metadata = self._handles[0].metadata() or {}
        self.prefix = common_prefix(self._where)
        raw = {k[len(self.prefix):]: k for k in self._where}
        self.legacy_fp8 = any(k.endswith("scaled_fp8") for k in raw)
        self.fused_qkv = any(_fused(k) is not None for k in raw)
        self._raw = raw
        # official name -> (stripped raw weight name, row third or None)
        self._map: dict[str, tuple[str, int | None]] = {}
        self.quantized_names: list[str] = []
        for k in raw:
            if k.endswith("scaled_fp8") or k == ROPE_KEY or k.rsplit(".", 1)[-1] in SIDE_KEYS:
                continue
            n = _fused(k)
            targets = list(zip(qkv_parts(n), range(3))) if n is not None else [(k, None)]
            for name, part in targets:
                self._map[name] = (k, part)
                if self._is_quantized(k):
                    self.quantized_names.append(name)

    @property
    def layout(self) -> str:
        if self.files.layout == "folder":
            return "official"
        if self.quantized_names:
            return "comfy-quantized"
        return "comfy" if self.fused_qkv or self.prefix else "single-file"

    def _get(self, stripped: str) -> torch.Tensor:
        full = self.prefix + stripped
        return self._handles[self._where[full]].get_tensor(full)

    def _dtype(self, stripped: str) -> str:
        full = self.prefix + stripped
        return self._handles[self._where[full]].get_slice(full).get_dtype()

    def _shape(self, stripped: str) -> list[int]:
        full = self.prefix + stripped
        return list(self._handles[self._where[full]].get_slice(full).get_shape())

    def _is_quantized(self, stripped: str) -> bool:
        stem = stripped.removesuffix(".weight")
        return stripped.endswith(".weight") and self._dtype(stripped) in QUANT_DTYPES and (
            f"{stem}.comfy_quant" in self._raw or self.legacy_fp8
            or any(f"{stem}.{s}" in self._raw for s in SCALE_NAMES))

    @property
    def names(self) -> list[str]:
        return list(self._map)

    @property
    def shapes(self) -> dict[str, list[int]]:
        out = {}
        for name, (k, part) in self._map.items():
            shape = self._shape(k)
            out[name] = [shape[0] // 3, *shape[1:]] if part is not None else shape
        return out

    def quantized(self, name: str) -> QuantizedWeight | None:
        """The stored quantized form of an official weight (rows of a fused qkv), or None."""
        k, part = self._map[name]
        if not self._is_quantized(k):
            return None
        stem = k.removesuffix(".weight")
        scale_key = next((f"{stem}.{s}" for s in SCALE_NAMES if f"{stem}.{s}" in self._raw), None)
        if scale_key is None:
            raise CheckpointError(f"{self.files.path}: {self.prefix}{k} is quantized but has no "
                                  f"weight_scale / scale_weight")
        fmt_key = f"{stem}.comfy_quant"
        fmt = parse_format(self._get(fmt_key) if fmt_key in self._raw else None)
        codes, scale = self._get(k), self._get(scale_key).float()
        if part is not None:
            rows = codes.shape[0] // 3
            codes = codes[part * rows:(part + 1) * rows]
            if scale.numel() == 3 * rows:
                scale = scale.reshape(-1)[part * rows:(part + 1) * rows]
        return quantized_weight(codes, scale, fmt, f"{self.files.path}: {self.prefix}{k}")

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The official tensor ``name``, dequantized, optionally cast."""
        k, part = self._map[name]
        q = self.quantized(name)
        if q is not None:
            t = q.dequantize(dtype or torch.float32)
        else:
            t = self._get(k)
            if part is not None:
                t = t.chunk(3, dim=0)[part].clone()  # a view would keep all of qkv alive
        return t.to(dtype) if dtype is not None else t

