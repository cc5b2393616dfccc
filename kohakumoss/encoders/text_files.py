"""Where the Qwen3.5 text encoder's weights, config and tokenizer come from
(``docs/encoders.md#text-encoder``): ``locate`` finds the weight files, the model folder and
a ``config.json`` for a pipeline root, a text-encoder folder or a single ComfyUI file;
``Weights`` reads the text model's tensors from them (any key prefix, ComfyUI int8/fp8
weights dequantized); ``infer_config`` derives the config from tensor shapes when no
``config.json`` is found; ``load_tokenizer`` finds the tokenizer beside them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import Qwen3_5TextConfig

from kohakumoss.errors import KohakuError
from kohakumoss.precision.quant import (QUANT_DTYPES, SCALE_NAMES, SIDE_KEYS, parse_format,
                                       quantized_weight)
from kohakumoss.tokenizer import open_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TOKENIZER_HELP = ("the text encoder needs tokenizer.json and tokenizer_config.json (with the chat "
                  "template, or a chat_template.jinja next to them): the tokenizer/ folder of the "
                  "MOSS-Image pipeline on Hugging Face (OpenMOSS-Team/MOSS-Image-Base)")
INDEX = "model.safetensors.index.json"
TEXT_KEYS = ("embed_tokens.", "layers.", "norm.")
EMBED = "embed_tokens.weight"
QWEN35_CONSTANTS = {  # Qwen3.5 values that no tensor shape reveals (Qwen3.5-9B's config.json)
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "rope_parameters": {
        "rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10], "mrope_interleaved": True}}
CANNOT = "cannot infer the Qwen3.5 config from tensor shapes"
LAYER_KINDS = (("linear_attention", "linear_attn.A_log"), ("full_attention", "self_attn.q_proj.weight"))
WHAT = ("give 'tiny', a MOSS-Image pipeline folder (with text_encoder/), a text-encoder folder "
        "or a ComfyUI text_encoders/*.safetensors file")


class TextEncoderError(KohakuError, ValueError):
    """A path or setting the text encoder cannot use; says what it expected."""


def text_config(fields: dict) -> Qwen3_5TextConfig:
    config = Qwen3_5TextConfig.from_dict({**QWEN35_CONSTANTS, **fields})
    config._attn_implementation = "sdpa"  # torch's own; no optional attention kernels
    return config


def infer_config(shapes: dict[str, tuple[int, ...]]) -> Qwen3_5TextConfig:
    """A config from the text model's tensor shapes (prefix stripped). Read: vocab and hidden
    size (embed_tokens), layer count and ``layer_types`` (which of ``linear_attn`` / ``self_attn``
    each layer has), MLP width, ``head_dim`` (q_norm), query heads (q_proj rows / 2 head_dim:
    query + gate), KV heads, attention bias, linear value head dim (gated norm) and count
    (A_log), linear key heads ((qkv rows - z rows) / 2 / head dim), conv kernel. Assumed: key
    head dim = value head dim (as in every Qwen3.5) and ``QWEN35_CONSTANTS``."""
    def need(key: str) -> tuple[int, ...]:
        if key not in shapes:
            raise TextEncoderError(f"{CANNOT}: tensor {key} is missing; put config.json next to it")
        return shapes[key]

    vocab, hidden = need("embed_tokens.weight")
    found = {int(k.split(".")[1]) for k in shapes if k.startswith("layers.")}
    n = max(found, default=-1) + 1
    if not n or found != set(range(n)):
        raise TextEncoderError(f"{CANNOT}: layer indices {sorted(found)[:8]} are not 0..N-1")
    types = []
    for i in range(n):
        kinds = [t for t, k in LAYER_KINDS if f"layers.{i}.{k}" in shapes]
        if len(kinds) != 1:
            raise TextEncoderError(f"{CANNOT}: layer {i} has {'both' if kinds else 'neither'} of "
                                   f"linear_attn and self_attn")
        types.append(kinds[0])
    fields = {"vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": n,
              "layer_types": types, "intermediate_size": need("layers.0.mlp.gate_proj.weight")[0]}
    if "full_attention" in types:
        p = f"layers.{types.index('full_attention')}.self_attn."
        hd = need(p + "q_norm.weight")[0]
        q, kv = need(p + "q_proj.weight")[0], need(p + "k_proj.weight")[0]
        if q % (2 * hd) or kv % hd:
            raise TextEncoderError(f"{CANNOT}: q_proj rows {q} / k_proj rows {kv} vs head_dim {hd}")
        fields.update(head_dim=hd, num_attention_heads=q // (2 * hd), num_key_value_heads=kv // hd,
                      attention_bias=p + "q_proj.bias" in shapes)
    if "linear_attention" in types:
        p = f"layers.{types.index('linear_attention')}.linear_attn."
        vd, nv = need(p + "norm.weight")[0], need(p + "A_log")[0]
        qkv, z = need(p + "in_proj_qkv.weight")[0], need(p + "in_proj_z.weight")[0]
        if z != nv * vd or (qkv - z) % (2 * vd):
            raise TextEncoderError(f"{CANNOT}: qkv / z rows {qkv} / {z} vs {nv} heads of {vd}")
        fields.update(linear_value_head_dim=vd, linear_key_head_dim=vd, linear_num_value_heads=nv,
                      linear_num_key_heads=(qkv - z) // (2 * vd),
                      linear_conv_kernel_dim=need(p + "conv1d.weight")[-1])
    return text_config(fields)


def read_config(file: Path) -> Qwen3_5TextConfig | None:
    """The text config of a Qwen3.5 ``config.json`` (multimodal or text), else None."""
    raw = json.loads(file.read_text())
    if raw.get("model_type") == "qwen3_5":
        raw = raw.get("text_config") or {}
    elif raw.get("model_type") != "qwen3_5_text":
        return None
    return text_config({k: v for k, v in raw.items() if k != "model_type"})


class Weights:
    """The text model's tensors in safetensors files, by stripped name, read one at a time;
    ComfyUI-quantized weights (codes + ``weight_scale`` [+ ``comfy_quant``]) dequantized."""

    def __init__(self, files: list[Path]):
        self.file, self.where = files[0], {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt")
            except (SafetensorError, OSError) as e:
                raise TextEncoderError(f"{f} is not a readable safetensors file ({e})") from None
            self.where.update((k, handle) for k in handle.keys())
        heads = [k.removesuffix(EMBED) for k in self.where if k.endswith(EMBED)]
        heads = [h for h in heads if h[-1:] in ("", ".") and h + "norm.weight" in self.where]
        if not heads:
            raise TextEncoderError(f"{self.file}: no Qwen3.5 text model in it (expected keys "
                                   f"[prefix]embed_tokens.weight, layers.N.*, norm.weight)")
        self.prefix = max(heads, key=lambda h: sum(k.startswith(h + "layers.") for k in self.where))
        names = (k[len(self.prefix):] for k in self.where if k.startswith(self.prefix))
        self.names = sorted(k for k in names
                            if k.startswith(TEXT_KEYS) and k.rsplit(".", 1)[-1] not in SIDE_KEYS)
        self.shapes = {k: tuple(self._slice(k).get_shape()) for k in self.names}
        self.quantized = [k for k in self.names if k.endswith(".weight") and self._scale(k)
                          and self._slice(k).get_dtype() in QUANT_DTYPES]

    def _slice(self, name: str):
        return self.where[self.prefix + name].get_slice(self.prefix + name)

    def _get(self, name: str) -> torch.Tensor:
        return self.where[self.prefix + name].get_tensor(self.prefix + name)

    def _scale(self, name: str) -> str | None:
        keys = (name.removesuffix("weight") + s for s in SCALE_NAMES)
        return next((k for k in keys if self.prefix + k in self.where), None)

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.quantized:
            return self._get(name)
        return self.stored(name).dequantize(torch.float32)

    def stored(self, name: str):
        """A ComfyUI-quantized weight as the file holds it (``QuantizedWeight``: codes,
        scale, format), or None for a weight it holds unquantized."""
        if name not in self.quantized:
            return None
        fmt = name.removesuffix("weight") + "comfy_quant"
        fmt = parse_format(self._get(fmt) if self.prefix + fmt in self.where else None)
        return quantized_weight(self._get(name), self._get(self._scale(name)), fmt, f"{self.file}: {name}")


def tokenizer_folder(model_dir: Path, explicit: str) -> Path:
    """An explicit folder (or its ``tokenizer/``) if given, else the first of the model dir,
    ``<dir>/tokenizer`` and ``<dir>/../tokenizer`` that holds tokenizer files."""
    tried = [Path(explicit), Path(explicit) / "tokenizer"] if explicit else [
        model_dir, model_dir / "tokenizer", model_dir.parent / "tokenizer"]
    folder = next((d for d in tried if any((d / f).is_file() for f in TOKENIZER_FILES)), None)
    if folder is None:
        raise TextEncoderError(f"no tokenizer found (looked in {', '.join(map(str, tried))}); "
                               f"{TOKENIZER_HELP}; pass that folder as tokenizer=")
    return folder


def load_tokenizer(model_dir: Path, explicit: str):
    return open_tokenizer(tokenizer_folder(model_dir, explicit), TextEncoderError, TOKENIZER_HELP)


def locate(path: Path, tokenizer: str) -> tuple[list[Path], Path, Qwen3_5TextConfig | None]:
    """Weight files, the model dir (for tokenizer discovery) and the config if one is found."""
    if not path.exists():
        raise TextEncoderError(f"text encoder path {path} does not exist; {WHAT}")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise TextEncoderError(f"{path} is not a .safetensors file; {WHAT}")
        tok = [Path(tokenizer), Path(tokenizer).parent / "text_encoder"] if tokenizer else []
        found = (d / "config.json" for d in [path.parent, *tok])
        configs = (read_config(f) for f in found if f.is_file())
        return [path], path.parent, next((c for c in configs if c is not None), None)
    folder = path / "text_encoder" if (path / "text_encoder").is_dir() else path
    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text()).get("weight_map", {})
        files = [folder / f for f in sorted(set(weight_map.values()))]
        if missing := [f.name for f in files if not f.is_file()]:
            raise TextEncoderError(f"{folder / INDEX} names missing shards: {', '.join(missing[:3])}")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise TextEncoderError(f"{folder} holds no .safetensors file; {WHAT}")
    config = None
    if (folder / "config.json").is_file():
        config = read_config(folder / "config.json")
        if config is None:
            raise TextEncoderError(f"{folder}/config.json is not Qwen3.5's (qwen3_5 or qwen3_5_text)")
    return files, folder, config
