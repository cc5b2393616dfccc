"""Images from prompts: the model (base, adapter files, training checkpoints), the encoders,
the sampler, PNGs with their settings in the metadata, and a contact sheet."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image, PngImagePlugin

from kohakumoss.artifacts import atomic_path
from kohakumoss.config import Params
from kohakumoss.diffusion.sampler import Request, sample
from kohakumoss.configlib import ConfigError
from kohakumoss.formats import load_dit
from kohakumoss.formats.model_files import stored_weights
from kohakumoss.formats.comfy import load_adapter_file
from kohakumoss.images import contact_sheet
from kohakumoss.quant.linear import QuantizedLinear
from kohakumoss.model.dit import MOSSImageTransformer
from kohakumoss.precision import sampling_policy
from kohakumoss.quant import quant_plan
from kohakumoss.formats.checkpoint import is_checkpoint
from kohakumoss.training.engines import hold_quantized, sampling_ops
from kohakumoss.formats.trained import load_trained


@dataclasses.dataclass
class Settings:
    width: int = 1024
    height: int = 1024
    steps: int = 50
    cfg: float = 3.0
    shift: float = 5.0
    negative: str = ""

    def check(self) -> None:
        if self.width % 16 or self.height % 16 or min(self.width, self.height) < 16:
            raise ValueError(f"image size {self.width}x{self.height}: both sides must be positive "
                             f"multiples of 16")


def split_strength(spec: str) -> tuple[Path, float]:
    """``path:0.8`` -> (path, 0.8); a plain path -> (path, 1.0)."""
    head, sep, tail = spec.rpartition(":")
    if sep and head:
        try:
            return Path(head), float(tail)
        except ValueError:
            pass
    return Path(spec), 1.0


def attach(model: MOSSImageTransformer, spec: str, seed: int = 0):
    """Apply ``path[:strength]``: a training checkpoint folder (``load_trained``: adapter or
    full weights) or an adapter file (ours, LyCORIS, ComfyUI; merged in). Returns a handle
    with ``remove()``, or None when full weights were loaded into the model."""
    path, m = split_strength(spec)
    if is_checkpoint(path):
        return load_trained(model, path, seed=seed, multiplier=m).adapters
    if path.is_file():  # merged in, unless the base is held quantized (run beside it then)
        mode = "bypass" if any(isinstance(x, QuantizedLinear) for x in model.modules()) else "merge"
        return load_adapter_file(model, path, multiplier=m, mode=mode)
    raise FileNotFoundError(f"adapter {spec!r}: not a checkpoint directory (runs/<name>/checkpoints/"
                            f"step-N) nor an adapter file")


class Generator:
    """The DiT (its op table from the kernel tuning table in ``kernels``, see
    ``sampling_ops``; its precision from ``sampling_policy``), the adapters in use, the text
    encoder and the VAE."""

    def __init__(self, p: Params, device: torch.device, dtype: torch.dtype,
                 adapters: Sequence[str] = (), kernels: Path | None = None):
        from kohakumoss.encoders.text import TextEncoder
        from kohakumoss.encoders.vae import VAE

        self.p, self.device, self.dtype = p, device, dtype
        quant = quant_plan(p.precision)
        self.policy = sampling_policy(dtype, p.precision, quant.base, quant.compute)
        try:
            self.policy.check_device(device)
        except ValueError as e:
            raise ConfigError(f"{p.path}: {e}") from None
        self.ops = sampling_ops(p, device, dtype, kernels)
        self.model = self._base()
        self.handles: list = []
        self.use(adapters)
        self.text = TextEncoder.load(p.model.text_encoder, tokenizer=p.model.tokenizer,
                                     dtype=p.encoders.text_dtype, device=str(device),
                                     stream=p.encoders.text_stream,
                                     precision=p.encoders.text_precision)
        self.vae = VAE.load(p.model.vae, dtype=p.encoders.vae_dtype, device=str(device))

    def _base(self) -> MOSSImageTransformer:
        quantized = self.policy.base != "keep"  # loaded on the host, quantized layer by layer
        path = self.p.model.transformer
        model = load_dit(path, self.policy.weights, "cpu" if quantized else self.device).eval()
        model.ops = self.ops
        hold_quantized(model, self.policy, self.device, stored_weights(path) if quantized else None)
        model.set_stream_scale(self.policy.stream_scale)
        return model

    def use(self, adapters: Sequence[str]) -> None:
        """Detach the current adapters (exactly) and attach ``adapters`` instead."""
        for h in reversed(self.handles):
            if h is None:  # full weights were loaded: only a reload restores the base
                self.model = self._base()
                break
            h.remove()
        self.handles = [attach(self.model, a, self.p.run.seed) for a in adapters]

    def images(self, prompts: Sequence[str], seeds: Sequence[int], s: Settings, batch: int = 4,
               progress=None) -> list[Image.Image]:
        s.check()
        hw = (s.height // 16, s.width // 16)
        embs = self.text.encode(list(prompts) + [s.negative])
        neg = embs[-1]
        out: list[Image.Image] = []
        for i in range(0, len(prompts), batch):
            reqs = [Request(e, neg, hw, seed) for e, seed in zip(embs[i:i + batch], seeds[i:i + batch])]
            latents = sample(self.model, reqs, s.steps, s.cfg, s.shift, device=self.device,
                             dtype=self.dtype, callback=progress)
            grid = torch.stack([t.T.reshape(-1, *hw) for t in latents]).to(self.device)
            pixels = self.vae.decode(grid).cpu()
            for px in pixels:
                arr = ((px.permute(1, 2, 0) + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
                out.append(Image.fromarray(arr.numpy(), "RGB"))
        return out


def save_png(image: Image.Image, path: Path, meta: dict) -> None:
    info = PngImagePlugin.PngInfo()
    info.add_text("kohakumoss", json.dumps(meta, sort_keys=True))
    with atomic_path(path) as tmp:
        image.save(tmp, format="PNG", pnginfo=info)


def grid(generator: Generator, prompts: Sequence[str], variants: Sequence[Sequence[str]],
         names: Sequence[str], seed: int, s: Settings) -> Image.Image:
    """Prompts (rows) x adapter variants (columns: checkpoints or strengths), one seed."""
    cells, labels = [], []
    columns: list[list[Image.Image]] = []
    for adapters in variants:
        generator.use(adapters)
        columns.append(generator.images(prompts, [seed] * len(prompts), s))
    generator.use(())
    for r, prompt in enumerate(prompts):
        for c, name in enumerate(names):
            cells.append(columns[c][r])
            labels.append(f"{name} | {prompt}")
    return contact_sheet(cells, labels, columns=len(variants))
