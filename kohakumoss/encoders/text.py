"""The frozen Qwen3.5 text encoder: captions -> per-token final hidden states.

``docs/encoders.md#text-encoder`` and ``docs/encoders.md#cache-keys``.
``TextEncoder.load(path)`` takes ``"tiny"`` (4 layers of width
48, both layer kinds, weights from a fixed seed: the tiny DiT's text encoder), a MOSS-Image
pipeline root (``text_encoder/`` + ``tokenizer/``), a text-encoder folder (``config.json`` of
type ``qwen3_5`` or ``qwen3_5_text``; safetensors, sharded with an index or not) or a ComfyUI
``text_encoders/*.safetensors`` file, bf16 or int8 / int8-ConvRot / fp8 (``checkpoints/quant.py``;
dequantized on load, so the precision stays ``compute``: ``key_id`` = ``<id>/<dtype>/compute``).

Only ``Qwen3_5TextModel`` is built (meta device, then filled tensor by tensor) from the keys
under the prefix of ``embed_tokens.weight`` with most layers (``model.language_model.``,
``model.``, ``language_model.``, none); vision tower, LM head and MTP keys are never read. Without a
Qwen3.5 ``config.json`` (the folder's; for a file: next to it, in the tokenizer folder or its
sibling ``text_encoder/``) the config comes from tensor shapes (``infer_config``).

Captions are wrapped by the tokenizer's own chat template and truncated at
``MAX_TEXT_TOKENS``, exactly as ``kohakumoss.data.tokens.TokenCounter`` counts them.
``encode`` runs right-padded rows grouped longest-first: every layer is causal, so padding
after a prompt cannot change its tokens. Legend: B rows, L tokens, D hidden width.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from collections.abc import Callable
from pathlib import Path

import torch
import transformers.models.qwen3_5.modeling_qwen3_5 as qwen
from transformers import Qwen3_5TextConfig

from kohakumoss.device import resolve_device
from kohakumoss.precision.dtypes import dtype_name, resolve_dtype
from kohakumoss.tokenizer import render_caption, templated_ids
from kohakumoss.tokenizer.tiny import tiny_tokenizer
from kohakumoss.encoders.text_files import (TOKENIZER_FILES, TextEncoderError, Weights,
                                            infer_config, load_tokenizer, locate, text_config,
                                            tokenizer_folder)


ENCODER_ID = "qwen3.5-9b"
TINY_ID = "qwen3.5-tiny"
DTYPE_NAMES = ("bf16", "fp16", "fp32")  # fp32 is ours (exact tests); the reference: bf16/fp16
MAX_TEXT_TOKENS = 4096
# transformers binds flash-linear-attention / causal-conv1d into these at import when the
# packages are importable, with no device check; off CUDA we call the PyTorch originals.
LINEAR_ATTENTION_OPS = ("causal_conv1d_fn", "causal_conv1d_update",
                        "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
TINY_SEED = 20240611


def tiny_config() -> Qwen3_5TextConfig:
    lin, full = "linear_attention", "full_attention"
    return text_config({
        "vocab_size": len(tiny_tokenizer()), "hidden_size": 48, "intermediate_size": 96,
        "num_hidden_layers": 4, "layer_types": [lin, lin, full, lin], "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4})


def tiny_state_dict(config: Qwen3_5TextConfig, seed: int = TINY_SEED) -> dict[str, torch.Tensor]:
    """Deterministic fp32 weights: same seed, same tensors (independent of torch's global RNG
    and of transformers' initialisers)."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in qwen.Qwen3_5TextModel(config).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        r = torch.randn(shape, generator=gen)
        if name.endswith("A_log"):
            r = torch.rand(shape, generator=gen).mul(15).add(1).log()
        elif name.endswith("linear_attn.norm.weight"):  # plain weight, not 1 + w
            r = 1 + 0.1 * r
        elif len(shape) == 1:  # zero-centred RMSNorm weights, dt_bias
            r = 0.1 * r
        elif name.endswith("conv1d.weight"):
            r = 0.5 * r
        elif not name.startswith("embed_tokens"):
            r = r / math.sqrt(shape[1])
        out[name] = r
    return out


def build_model(config: Qwen3_5TextConfig, names: list[str], get: Callable[[str], torch.Tensor],
                dtype: torch.dtype, device: torch.device, where: str) -> torch.nn.Module:
    """``Qwen3_5TextModel`` on the meta device, each weight read, checked, cast and placed."""
    with torch.device("meta"):
        model = qwen.Qwen3_5TextModel(config)
    expected = dict(model.named_parameters())
    missing, unknown = sorted(set(expected) - set(names)), sorted(set(names) - set(expected))
    if missing or unknown:
        raise TextEncoderError(f"{where}: weights do not match the Qwen3.5 config: missing {missing[:4]} "
                               f"({len(missing)}), unexpected {unknown[:4]} ({len(unknown)})")
    for name, param in expected.items():
        t = get(name)
        if tuple(t.shape) != tuple(param.shape):
            raise TextEncoderError(f"{where}: {name} is {tuple(t.shape)}, expected {tuple(param.shape)}")
        module_name, _, attr = name.rpartition(".")
        model.get_submodule(module_name)._parameters[attr] = torch.nn.Parameter(
            t.to(device=device, dtype=dtype), requires_grad=False)
    model.rotary_emb = qwen.Qwen3_5TextRotaryEmbedding(config).to(device)  # fp32 inv_freq
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    return model.eval().requires_grad_(False)


PRECISION_IDS = {"keep": "compute", "int8": "int8", "fp8": "fp8", "fp8-compute": "fp8-compute"}
"""``encoders.text_precision`` -> its part of the encoder's key (``keep``: the keys as before)."""


def check_text_precision(precision: str, device: torch.device) -> None:
    if precision not in PRECISION_IDS:
        raise TextEncoderError(f"encoders.text_precision {precision!r}: one of {', '.join(PRECISION_IDS)}")
    if precision == "fp8-compute" and device.type == "cuda" and \
            torch.cuda.get_device_capability(device) < (8, 9):
        raise TextEncoderError(f"encoders.text_precision: fp8-compute runs fp8 GEMMs, which "
                               f"{torch.cuda.get_device_name(device)} (sm"
                               f"{''.join(map(str, torch.cuda.get_device_capability(device)))}) "
                               f"has not (sm89+); use int8 or fp8 (weight-only)")


@torch.no_grad()
def quantize_layers(model: torch.nn.Module, precision: str,
                    stored: Callable[[str], object] | None = None) -> str:
    """Every ``nn.Linear`` of the decoder layers as a ``QuantizedLinear`` (per-row codes
    and float32 scales, ``quant.linear``); the embeddings and the final norm stay.
    ``stored``: a ComfyUI file's quantized form of a weight by name, whose codes and scales
    (and ConvRot rotation) are used as stored where their format is the precision's. Returns
    a one-line account."""
    from kohakumoss.quant.linear import QuantizedLinear, quantize_rows, stored_rows

    base = "fp8" if precision == "fp8-compute" else precision
    layers = [(f"layers.{i}.{name}", m) for i, layer in enumerate(model.layers)
              for name, m in layer.named_modules() if type(m) is torch.nn.Linear]
    before = after = kept = 0
    for path, lin in layers:
        got = stored_rows(stored(f"{path}.weight"), base) if stored is not None else None
        if got is not None and not (precision == "fp8-compute" and got[2]):
            codes, scale, group = got
            codes, scale, kept = codes.to(lin.weight.device), scale.to(lin.weight.device), kept + 1
        else:  # quantized per row from the loaded weight
            (codes, scale), group = quantize_rows(lin.weight.detach(), base), 0
        q = QuantizedLinear(codes, scale, lin.bias, lin.weight.dtype, group=group,
                            fp8_compute=precision == "fp8-compute")
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent), name, q)
        before += lin.weight.numel() * lin.weight.element_size()
        after += codes.numel() * codes.element_size() + scale.numel() * 4
    how = "fp8 GEMMs" if precision == "fp8-compute" else f"{base} weight-only"
    src = f", {kept} taken from the file as stored" if kept else ""
    return (f"{how}: {len(layers)} layer linears in {after / 2**30:.2f} GiB (was "
            f"{before / 2**30:.2f} GiB){src}")


def torch_reference(fn: Callable) -> Callable:
    """The pure-PyTorch function under transformers' hub-kernel wrappers: ``functools.wraps``
    chains (``__wrapped__``), and from transformers 5.25 (with the ``kernels`` package) an
    ``nn.Module`` whose ``forward`` calls that chain."""
    fn = inspect.unwrap(fn)
    if isinstance(fn, torch.nn.Module):
        inner = [c.cell_contents for c in type(fn).forward.__closure__ or ()
                 if callable(c.cell_contents) and hasattr(c.cell_contents, "__wrapped__")]
        if len(inner) == 1:
            return inspect.unwrap(inner[0])
    return fn


@contextlib.contextmanager
def torch_linear_attention_ops(device: torch.device):
    """Off CUDA, run Gated DeltaNet on transformers' pure-PyTorch ops while inside. Patches the
    module's globals, so it is not thread-safe against a concurrent CUDA forward."""
    if device.type == "cuda":
        yield
        return
    saved = {n: getattr(qwen, n) for n in LINEAR_ATTENTION_OPS}
    try:
        for n, fn in saved.items():
            setattr(qwen, n, torch_reference(fn))
        yield
    finally:
        for n, fn in saved.items():
            setattr(qwen, n, fn)


def group_longest_first(lengths: list[int], batch: int, max_tokens: int) -> list[list[int]]:
    """Indices in calls of <= ``batch`` rows and <= ``max_tokens`` padded tokens (0 = no cap),
    longest first; a prompt over the cap gets a call of its own."""
    if batch < 1 or max_tokens < 0:
        raise TextEncoderError(f"batch must be >= 1 and max_tokens >= 0, got {batch}, {max_tokens}")
    calls: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        cur = calls[-1] if calls else None
        fits = cur and len(cur) < batch and (not max_tokens or (len(cur) + 1) * lengths[cur[0]] <= max_tokens)
        if fits:
            cur.append(i)
        else:
            calls.append([i])
    return calls



log = logging.getLogger(__name__)
STREAM_SLOTS = 4  # layers of the text encoder on the device at once when streamed
STREAM_SHARE = 0.8  # auto streams weights larger than this share of the free device memory


def _streams(stream: str, device: torch.device, size: int) -> bool:
    if stream not in ("auto", "on", "off"):
        raise ValueError(f"text encoder stream {stream!r}: one of auto, on, off")
    if device.type != "cuda" or stream == "off":
        return False
    return stream == "on" or size > STREAM_SHARE * torch.cuda.mem_get_info(device)[0]


class TextEncoder:
    """Frozen Qwen3.5 text model + tokenizer; ``encode`` gives ``[L_i, hidden]`` per caption."""

    max_length = MAX_TEXT_TOKENS

    def __init__(self, model: torch.nn.Module, tokenizer, encoder_id: str, ring=None,
                 precision: str = "keep"):
        self.model, self.tokenizer, self.encoder_id = model, tokenizer, encoder_id
        self.ring = ring  # the layers' weight ring when they stream (``memory/streaming.py``)
        self.precision = PRECISION_IDS[precision]  # part of the cache keys: another precision,
        # other entries
        if len(tokenizer) > model.config.vocab_size:
            raise TextEncoderError(f"the tokenizer has {len(tokenizer)} tokens, more than the model's "
                                   f"vocab_size {model.config.vocab_size}; they do not belong together")

    @classmethod
    def load(cls, path: str, tokenizer: str = "", dtype: str = "auto", device: str = "cpu",
             stream: str = "off", precision: str = "keep") -> TextEncoder:
        """``stream``: ``on`` streams the layers' weights from host memory through
        ``STREAM_SLOTS`` device slots (``kohakumoss.memory.streaming``; the same outputs),
        ``auto`` when the weights do not fit ``STREAM_SHARE`` of the device's free memory,
        ``off`` never; only on a CUDA device (elsewhere the weights are in host memory).
        ``precision`` (``encoders.text_precision``): ``keep`` the weights in ``dtype``;
        ``int8`` / ``fp8`` the layers' linears held as per-row codes and scales, dequantized
        in each product (weight-only); ``fp8-compute`` fp8 codes multiplied as fp8 GEMMs
        with the activations quantized per row (sm89+ cards)."""
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev, DTYPE_NAMES)
        check_text_precision(precision, dev)
        if path == "tiny":
            if tokenizer not in ("", "tiny"):
                raise TextEncoderError(f"the tiny text encoder uses the tiny tokenizer, not {tokenizer!r}")
            sd = tiny_state_dict(config := tiny_config())
            names, get, tok, eid = list(sd), sd.__getitem__, tiny_tokenizer(), TINY_ID
            shapes, stored = {k: tuple(v.shape) for k, v in sd.items()}, None
        else:
            files, model_dir, config = locate(Path(path), tokenizer)
            tok = load_tokenizer(model_dir, tokenizer)
            weights = Weights(files)
            config = config or infer_config(weights.shapes)
            names, get, eid, shapes = weights.names, weights.tensor, ENCODER_ID, weights.shapes
            stored = weights.stored if weights.quantized else None
        size = sum(math.prod(s) for s in shapes.values()) * torch.empty((), dtype=dt).element_size()
        if precision != "keep":  # built on the host, quantized, then the codes on the device
            model = build_model(config, names, get, dt, torch.device("cpu"), path)
            log.info("text encoder %s: %s", path, quantize_layers(model, precision, stored))
            return cls(model.to(dev), tok, eid, precision=precision)
        if not _streams(stream, dev, size):
            return cls(build_model(config, names, get, dt, dev, path), tok, eid)
        from kohakumoss.memory.streaming import stream_weights

        model = build_model(config, names, get, dt, torch.device("cpu"), path)
        ring = stream_weights(model, dev, STREAM_SLOTS, blocks=list(model.layers))
        log.info("text encoder %s: %.1f GiB of layer weights streamed from host memory through %d "
                 "slots (%.1f GiB on %s)", path, ring.host_bytes() / 2**30, ring.n_slots,
                 ring.resident_bytes() / 2**30, dev)
        return cls(model, tok, eid, ring)

    @classmethod
    def identity(cls, path: str, dtype: str = "auto", device: str = "cpu",
                 precision: str = "keep") -> str:
        """The ``key_id`` that ``load(path, dtype=dtype, device=device, precision=precision)``
        will report, without loading anything (cache keys are computed before the encoder is
        needed)."""
        dt = resolve_dtype(dtype, resolve_device(device), DTYPE_NAMES)
        return f"{TINY_ID if path == 'tiny' else ENCODER_ID}/{dtype_name(dt)}/{PRECISION_IDS[precision]}"

    @staticmethod
    def weight_files(path: str, tokenizer: str = "") -> list[Path]:
        """The weight files ``load(path, tokenizer)`` reads and its tokenizer's files (none
        for ``tiny``), for ``fingerprint``: another tokenizer gives other embeddings too."""
        if path == "tiny":
            return []
        files, model_dir, _ = locate(Path(path), tokenizer)
        folder = tokenizer_folder(model_dir, tokenizer)
        return files + [folder / f for f in TOKENIZER_FILES if (folder / f).is_file()]

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def key_id(self) -> str:
        return f"{self.encoder_id}/{dtype_name(self.dtype)}/{self.precision}"

    def to(self, device: str | torch.device) -> TextEncoder:
        self.model.to(resolve_device(device))
        return self

    def render(self, caption: str) -> str:
        return render_caption(self.tokenizer, caption)

    def token_ids(self, captions: list[str]) -> list[list[int]]:
        return templated_ids(self.tokenizer, captions, self.max_length)

    @torch.inference_mode()
    def encode(self, captions: list[str], batch: int = 32, max_tokens: int = 16384) -> list[torch.Tensor]:
        """Per caption, in input order: the final-norm hidden state of every token, ``[L_i, D]``,
        unpadded, model dtype, on the CPU."""
        ids = self.token_ids(captions)
        lengths = [len(i) for i in ids]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        out: list[torch.Tensor | None] = [None] * len(ids)
        for call in group_longest_first(lengths, batch, max_tokens):
            width = lengths[call[0]]
            ids_BL = torch.full((len(call), width), pad, dtype=torch.long)
            mask_BL = torch.zeros((len(call), width), dtype=torch.long)
            for r, i in enumerate(call):
                ids_BL[r, :lengths[i]] = torch.tensor(ids[i], dtype=torch.long)
                mask_BL[r, :lengths[i]] = 1
            with torch_linear_attention_ops(self.device), \
                    self.ring.running() if self.ring is not None else contextlib.nullcontext():
                h_BLD = self.model(input_ids=ids_BL.to(self.device), use_cache=False,
                                   attention_mask=mask_BL.to(self.device)).last_hidden_state
            for r, i in enumerate(call):
                out[i] = h_BLD[r, :lengths[i]].to("cpu", copy=True)
        return out  # type: ignore[return-value]

