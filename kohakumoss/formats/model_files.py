"""Checkpoint formats of the MOSS-Image transformer: one adapter per file layout.

- ``load_transformer(path)``: auto-detects the official Hugging Face layout (pipeline root
  or ``transformer/`` folder, sharded with an index), a ComfyUI single file (prefixed or
  bare keys, fused ``proj.qkv``) and ComfyUI's quantized files (int8, int8 ConvRot, fp8;
  dequantized on load, the quantized tensors stay reachable through ``LoadInfo.reader``).
  The model is built on the meta device and materialised tensor by tensor.
- ``save_official(state, folder)`` and ``save_comfy(state, file)``: the two writers.
- ``load_dit(path, dtype, device)``: a params value (``"tiny"`` or a checkpoint path) to a
  DiT in ``dtype``; ``stored_weights(path)``: its quantized tensors as stored (a quantized
  base takes them as they are, ``kohakumoss.quant.linear``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch


from kohakumoss.artifacts import atomic_path, atomic_write_json, write_safetensors
from kohakumoss.formats.keys import ROPE_KEY, check_keys, fuse_qkv
from kohakumoss.formats.reader import INDEX, CheckpointError, TransformerReader, locate
from kohakumoss.model.build import tiny_transformer
from kohakumoss.model.config import FLAVORS, DiTConfig, infer_config
from kohakumoss.model.dit import FP32_MODULES, MOSSImageTransformer, RopeBands, cast_model
from kohakumoss.model.ops import compute_dtype
from kohakumoss.precision.quant import QuantizedWeight, encode_format, quantize_fp8, quantize_int8

__all__ = ["CheckpointError", "LoadInfo", "load_transformer", "read_config", "save_comfy",
           "save_official", "locate"]


@dataclasses.dataclass
class LoadInfo:
    layout: str  # official | single-file | comfy | comfy-quantized
    config: DiTConfig
    files: list[Path]
    prefix: str
    fused_qkv: bool
    quantized: list[str]
    reader: TransformerReader


def read_config(path: str | Path) -> tuple[DiTConfig, TransformerReader]:
    reader = TransformerReader(locate(path))
    try:
        return infer_config(reader.shapes, reader.files.hf_config), reader
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def _assign(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    old = module._parameters[attr]
    module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=old.requires_grad)


def load_transformer(path: str | Path, dtype: torch.dtype = torch.bfloat16,
                     device: torch.device | str = "cpu") -> tuple[MOSSImageTransformer, LoadInfo]:
    """Load any supported checkpoint into a model in compute ``dtype`` on ``device``."""
    config, reader = read_config(path)
    with torch.device("meta"):
        model = MOSSImageTransformer(config)
    expected = list(model.state_dict())
    check_keys(reader.names, expected, str(path))
    shapes = reader.shapes
    keep = compute_dtype(dtype)
    for name in expected:
        want = tuple(model.get_parameter(name).shape)
        if tuple(shapes[name]) != want:
            raise CheckpointError(f"{path}: {name} has shape {tuple(shapes[name])}, expected {want} "
                                  f"for the config inferred from the file")
        target = keep if name.startswith(FP32_MODULES) else dtype
        _assign(model, name, reader.tensor(name).to(device=device, dtype=target))
    model.rope.reset(device)
    return model, LoadInfo(reader.layout, config, reader.files.files, reader.prefix,
                           reader.fused_qkv, reader.quantized_names, reader)


def _state(state: MOSSImageTransformer | Mapping[str, torch.Tensor], dtype: torch.dtype | None
           ) -> dict[str, torch.Tensor]:
    sd = state.state_dict() if isinstance(state, torch.nn.Module) else dict(state)
    sd = {k: v for k, v in sd.items() if k != ROPE_KEY}
    out = {k: (v.detach().to(dtype) if dtype is not None else v.detach()).contiguous().cpu()
           for k, v in sd.items()}
    return out


def _rope(config: DiTConfig) -> torch.Tensor:
    """The derived fp32 ``rope.bands`` buffer the reference writes into every file."""
    return RopeBands(config.rope_bands, config.rope_base).compute()


def save_official(state, folder: str | Path, config: DiTConfig, dtype: torch.dtype | None = torch.bfloat16,
                  max_shard_bytes: int = 5 * 10**9) -> Path:
    """A diffusers-style transformer folder: config.json, shards in state-dict order, index."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sd = _state(state, dtype)
    sd[ROPE_KEY] = _rope(config)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in sd.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    names = [f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
             for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        with atomic_path(folder / name) as tmp:
            write_safetensors(shard, tmp, {"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(v.numel() * v.element_size() for v in sd.values())
    atomic_write_json(folder / "config.json", config.hf_config())
    atomic_write_json(folder / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return folder


def _quantizable(name: str, t: torch.Tensor, group: int) -> bool:
    return (t.ndim == 2 and name.endswith(".weight") and not name.startswith(FP32_MODULES)
            and not name.startswith(("video_embedder", "final_linear_video"))
            and (group == 0 or t.shape[1] % group == 0))


def save_comfy(state, path: str | Path, config: DiTConfig, dtype: torch.dtype | None = torch.bfloat16,
               prefix: str = "", fused: bool = True, quantize: str | None = None,
               metadata: dict[str, str] | None = None) -> Path:
    """A ComfyUI single file: fused joint qkv, optional prefix, optional quantization
    (``int8``, ``int8_convrot``, ``fp8``) of the 2-D linear weights it applies to."""
    sd = _state(state, None)
    sd = fuse_qkv(sd) if fused else sd
    out: dict[str, torch.Tensor] = {}
    group = 256 if quantize == "int8_convrot" else 0
    for k, v in sd.items():
        if quantize and _quantizable(k, v, group):
            codes, scale, fmt = quantize_fp8(v) if quantize == "fp8" else quantize_int8(v, group)
            stem = k.removesuffix(".weight")
            out[f"{prefix}{k}"] = codes
            out[f"{prefix}{stem}.weight_scale"] = scale.float()
            out[f"{prefix}{stem}.comfy_quant"] = encode_format(fmt)
        else:
            out[f"{prefix}{k}"] = v.to(dtype) if dtype is not None else v
    out[f"{prefix}{ROPE_KEY}"] = _rope(config)
    meta = {"format": "pt", **(metadata or {})}
    if quantize:
        meta["_quantization_metadata"] = json.dumps({"format": quantize})
    path = Path(path)
    with atomic_path(path) as tmp:
        write_safetensors(out, tmp, meta)
    return path


def load_dit(path: str, dtype: torch.dtype, device: torch.device | str) -> MOSSImageTransformer:
    if path == "tiny":
        return cast_model(tiny_transformer(), dtype).to(device)
    model, _ = load_transformer(path, dtype=dtype, device=device)
    return model


def dit_shapes(path: str) -> MOSSImageTransformer:
    """The checkpoint's transformer on the meta device: its modules and every shape, read
    from the file's header (no weight is read or held); the names and shapes are checked as
    ``load_transformer`` checks them. An export that needs only the base's shapes (an
    adapter's own tensors) builds on it."""
    if path == "tiny":
        config = FLAVORS["tiny"]
    else:
        config, reader = read_config(path)
        with torch.device("meta"):
            expected = MOSSImageTransformer(config).state_dict()
        check_keys(reader.names, list(expected), str(path))
        bad = [n for n, t in expected.items() if tuple(reader.shapes[n]) != tuple(t.shape)]
        if bad:
            raise CheckpointError(f"{path}: {bad[0]} has shape {tuple(reader.shapes[bad[0]])}, "
                                  f"expected {tuple(expected[bad[0]].shape)} for the config "
                                  f"inferred from the file")
    with torch.device("meta"):
        return MOSSImageTransformer(config).eval()


def stored_weights(path: str) -> Callable[[str], QuantizedWeight | None] | None:
    """For a quantized checkpoint, its quantized form of a weight by state-dict name (None for
    a weight it holds unquantized); None for any other checkpoint."""
    if path == "tiny":
        return None
    reader = TransformerReader(locate(path))
    if not reader.quantized_names:
        return None
    names = set(reader.quantized_names)
    return lambda name: reader.quantized(name) if name in names else None
