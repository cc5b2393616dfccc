"""The frozen FLUX.2 VAE (``docs/encoders.md#vae``): pixels <-> normalised 128-channel latents.

Legend: B images, H W pixels (multiples of 16), z the VAE latent ``[B, 32, H/8, W/8]``,
P the 2x2-patchified latent ``[B, 128, h, w]`` with ``h, w = H/16, W/16``, tokens
``[h*w, 128]`` row-major (token ``y*w + x``).

``VAE.load(path)`` takes ``"tiny"`` (a small random model built in code, for tests), a
pipeline root holding ``vae/``, a ``vae/`` folder (diffusers layout), or one ComfyUI
``vae/*.safetensors`` file in diffusers naming or in the Black Forest Labs / LDM naming
(``encoder.down.N.block.M``, ``encoder.quant_conv``, ``bn.running_mean``), optionally under
a ``vae.`` / ``first_stage_model.`` prefix. ``encode`` returns fp32 latents normalised by
the VAE's BatchNorm running statistics (read in fp32 before the model is cast);
``decode`` is the exact inverse. diffusers is imported only when a model is built, so the
pure layout functions (``patchify``, ``to_tokens``, ...) cost nothing to import.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kohakumoss.device import resolve_device
from kohakumoss.precision.dtypes import dtype_name, resolve_dtype
from kohakumoss.errors import KohakuError

if TYPE_CHECKING:
    from diffusers import AutoencoderKLFlux2

LATENT_ID = "flux2-vae"
TINY_ID = "flux2-vae-tiny"
SIZE_STEP = 16  # pixels per latent token side: 8 (VAE) x 2 (patchify)
CHANNELS = 128
PREFIXES = ("vae.", "first_stage_model.")
FILE_SUFFIXES = (".safetensors", ".sft")
# small widths, but 4 blocks (factor 8) and 32 latent channels like the real VAE; the
# first block is narrower so the BFL naming test also covers ``nin_shortcut`` keys
TINY_CONFIG = {"block_out_channels": (16, 32, 32, 32), "layers_per_block": 1,
               "latent_channels": 32, "norm_num_groups": 8, "sample_size": 64}
TINY_SEED = 0
VAE_DTYPES = ("fp32", "bf16", "fp16")  # plus "auto": bf16 / fp16 on accelerators, fp32 on CPU
DRAWS = ("mode", "sample")
WHAT = ("give 'tiny', a MOSS-Image pipeline folder (with vae/), its vae/ folder, or a "
        "ComfyUI vae/*.safetensors file")


class VAEError(KohakuError, ValueError):
    """A path or input the VAE cannot use; says what was expected."""


# ---- pure layout functions ---------------------------------------------------------------

def patchify(z_BCHW: torch.Tensor) -> torch.Tensor:
    """``P[b, 4c + 2i + j, y, x] = z[b, c, 2y + i, 2x + j]``
    (``docs/encoders.md#patchify-and-tokens``)."""
    b, c, hh, ww = z_BCHW.shape
    if hh % 2 or ww % 2:
        raise VAEError(f"cannot patchify a latent of spatial size {hh}x{ww}: both must be even")
    z = z_BCHW.reshape(b, c, hh // 2, 2, ww // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return z.reshape(b, c * 4, hh // 2, ww // 2)


def unpatchify(p_BChw: torch.Tensor) -> torch.Tensor:
    """Exact inverse of ``patchify``: ``[B, 4C, h, w]`` -> ``[B, C, 2h, 2w]``."""
    b, c4, h, w = p_BChw.shape
    if c4 % 4:
        raise VAEError(f"cannot unpatchify {c4} channels: not a multiple of 4")
    z = p_BChw.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return z.reshape(b, c4 // 4, h * 2, w * 2)


def to_tokens(latents_BChw: torch.Tensor) -> list[torch.Tensor]:
    """Per image ``[h*w, C]``, row-major (token ``y*w + x`` = ``latents[b, :, y, x]``).

    Each entry owns its storage, so saving one never writes the whole batch.
    """
    return [lat.flatten(1).T.contiguous() for lat in latents_BChw]


def from_tokens(tokens: torch.Tensor | list[torch.Tensor], hw: tuple[int, int]) -> torch.Tensor:
    """Inverse of ``to_tokens``: a list of ``[h*w, C]`` (or ``[B, h*w, C]``, or one
    ``[h*w, C]`` as B=1) -> ``[B, C, h, w]``."""
    t = torch.stack(list(tokens)) if isinstance(tokens, (list, tuple)) else tokens
    t = t.unsqueeze(0) if t.ndim == 2 else t
    h, w = hw
    if t.ndim != 3 or t.shape[1] != h * w:
        raise VAEError(f"tokens of shape {list(t.shape)} do not hold a {h}x{w} grid "
                       f"(expected [{h * w}, C] per image)")
    return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], h, w)


def batch_groups(sizes: list[tuple[int, int]], max_pixels: int, batch: int) -> list[list[int]]:
    """Indices of consecutive same-size images encoded together: at most ``batch`` images
    and ``max_pixels`` pixels per group, at least one image
    (``docs/encoders.md#vae-dtype-and-batching``)."""
    if batch < 1:
        raise VAEError(f"encode batch must be >= 1, got {batch}")
    groups: list[list[int]] = []
    for i, (h, w) in enumerate(sizes):
        g = groups[-1] if groups else None
        if (g and sizes[g[0]] == (h, w) and len(g) < batch
                and (len(g) + 1) * h * w <= max_pixels):
            g.append(i)
        else:
            groups.append([i])
    return groups


# ---- the VAE -----------------------------------------------------------------------------

class VAE:
    """Frozen FLUX.2 autoencoder with its latent normalisation; no gradients, eval mode."""

    def __init__(self, model: AutoencoderKLFlux2, dtype: torch.dtype, device: torch.device,
                 encoder_id: str):
        cfg = model.config
        if (len(cfg.block_out_channels) != 4 or tuple(cfg.patch_size) != (2, 2)
                or model.bn.num_features != CHANNELS):
            raise VAEError(f"VAE config has {len(cfg.block_out_channels)} blocks, patch size "
                           f"{tuple(cfg.patch_size)}, {model.bn.num_features} BatchNorm "
                           f"channels; the FLUX.2 VAE has 4, (2, 2) and {CHANNELS}")
        # statistics in fp32 before the cast (docs/encoders.md#latent-normalisation)
        self.mean = model.bn.running_mean.detach().float().clone().to(device)
        self.std = torch.sqrt(model.bn.running_var.detach().float() + cfg.batch_norm_eps).to(device)
        # nn.Module.to: diffusers' override warns about fp32 modules this class does not have
        self.model = torch.nn.Module.to(model.requires_grad_(False).eval(), device, dtype)
        self.dtype, self.device = dtype, device
        self.key_id = f"{encoder_id}/{dtype_name(dtype)}"

    @classmethod
    def load(cls, path: str, dtype: str = "auto", device: str = "cpu") -> VAE:
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev, allowed=VAE_DTYPES, cpu_auto="fp32")
        if str(path) == "tiny":
            return cls(build_tiny(), dt, dev, TINY_ID)
        return cls(load_model(Path(path)), dt, dev, LATENT_ID)

    @staticmethod
    def identity(path: str, dtype: str = "auto", device: str = "cpu") -> str:
        """The ``key_id`` that ``load(path, dtype, device)`` reports, without loading
        anything (``docs/encoders.md#cache-keys``): ``flux2-vae/<fp32|bf16|fp16>``
        (``flux2-vae-tiny/...``)."""
        dt = resolve_dtype(dtype, resolve_device(device), allowed=VAE_DTYPES, cpu_auto="fp32")
        return f"{TINY_ID if str(path) == 'tiny' else LATENT_ID}/{dtype_name(dt)}"

    @staticmethod
    def weight_files(path: str) -> list[Path]:
        """The files ``load(path)`` reads the weights from (none for ``tiny``), for
        ``fingerprint``."""
        if str(path) == "tiny":
            return []
        p = Path(path)
        if p.is_file():
            return [p]
        folder = _folder(p)
        return sorted(f for f in folder.iterdir() if f.suffix in FILE_SUFFIXES) if folder.is_dir() else []

    @property
    def config(self):
        return self.model.config

    def normalise(self, p_B128hw: torch.Tensor) -> torch.Tensor:
        """``(P - running_mean) / sqrt(running_var + eps)`` per channel, in fp32."""
        return (p_B128hw.float() - self.mean[:, None, None]) / self.std[:, None, None]

    def denormalise(self, latents_B128hw: torch.Tensor) -> torch.Tensor:
        return latents_B128hw.float() * self.std[:, None, None] + self.mean[:, None, None]

    @torch.no_grad()
    def encode(self, pixels_B3HW: torch.Tensor, draw: str = "mode",
               generator: torch.Generator | None = None) -> torch.Tensor:
        """Pixels in [-1, 1] -> normalised fp32 latents ``[B, 128, H/16, W/16]``."""
        if draw not in DRAWS:
            raise VAEError(f"posterior draw {draw!r} is not one of {', '.join(DRAWS)}")
        _check_pixels(pixels_B3HW)
        dist = self.model.encode(pixels_B3HW.to(self.device, self.dtype)).latent_dist
        z = dist.mode() if draw == "mode" else dist.sample(generator)
        return self.normalise(patchify(z.float()))

    @torch.no_grad()
    def decode(self, latents_B128hw: torch.Tensor) -> torch.Tensor:
        """Normalised latents -> fp32 pixels ``[B, 3, 16h, 16w]`` clamped to [-1, 1]."""
        if latents_B128hw.ndim != 4 or latents_B128hw.shape[1] != CHANNELS:
            raise VAEError(f"decode takes latents [B, {CHANNELS}, h, w], got "
                           f"{list(latents_B128hw.shape)}")
        z = unpatchify(self.denormalise(latents_B128hw.to(self.device)))
        return self.model.decode(z.to(self.dtype)).sample.float().clamp(-1, 1)

    def encode_batches(self, pixels: list[torch.Tensor], max_pixels: int = 4 * 1024 * 1024,
                       batch: int = 8, draw: str = "mode",
                       generator: torch.Generator | None = None) -> list[torch.Tensor]:
        """``[3, H, W]`` images -> tokens ``[h*w, 128]`` each, in input order; consecutive
        same-size images share one encode call (``batch_groups``). With ``draw="sample"``
        the noise each image gets depends on the grouping."""
        out: list[torch.Tensor] = []
        for group in batch_groups([tuple(p.shape[-2:]) for p in pixels], max_pixels, batch):
            out.extend(to_tokens(self.encode(torch.stack([pixels[i] for i in group]),
                                             draw, generator)))
        return out


def _check_pixels(pixels_B3HW: torch.Tensor) -> None:
    if pixels_B3HW.ndim != 4 or pixels_B3HW.shape[1] != 3 or not pixels_B3HW.is_floating_point():
        raise VAEError(f"encode takes float pixels [B, 3, H, W] in [-1, 1], got "
                       f"{list(pixels_B3HW.shape)} {pixels_B3HW.dtype}")
    h, w = pixels_B3HW.shape[-2:]
    if h % SIZE_STEP or w % SIZE_STEP:
        raise VAEError(f"image size {h}x{w} (HxW) is not a multiple of {SIZE_STEP} on both "
                       f"sides; resize or crop to multiples of {SIZE_STEP} (the resolution "
                       f"planner's buckets already are)")


# ---- building and loading the model ------------------------------------------------------

def _flux2_class():
    from diffusers import AutoencoderKLFlux2
    return AutoencoderKLFlux2


def build_tiny() -> AutoencoderKLFlux2:
    """Deterministic small FLUX.2 VAE with non-trivial BatchNorm statistics (fp32, CPU)."""
    cls = _flux2_class()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = cls(**TINY_CONFIG)
    i = torch.arange(model.bn.num_features, dtype=torch.float64)
    model.bn.running_mean.copy_(0.5 * torch.sin(i))
    model.bn.running_var.copy_(1.5 + torch.cos(0.7 * i))  # in [0.5, 2.5]
    return model


def _folder(path: Path) -> Path:
    """A pipeline root's ``vae/``, else the folder itself."""
    return path / "vae" if (path / "vae").is_dir() else path


def load_model(path: Path) -> AutoencoderKLFlux2:
    """fp32 ``AutoencoderKLFlux2`` on the CPU from a pipeline root, ``vae/`` folder or file."""
    if not path.exists():
        raise VAEError(f"VAE path {path} does not exist; {WHAT}")
    if path.is_file():
        return _load_file(path)
    folder = _folder(path)
    config = _read_config(folder / "config.json")
    if config is None:
        raise VAEError(f"{folder} has no config.json; {WHAT}")
    try:
        # low_cpu_mem_usage=False: the same load without accelerate, and without diffusers'
        # advice to install it (the VAE is small)
        return _flux2_class().from_pretrained(folder, torch_dtype=torch.float32,
                                              local_files_only=True, low_cpu_mem_usage=False)
    except OSError as e:
        raise VAEError(f"{folder}: cannot load the diffusers VAE ({e}); {WHAT}") from None


def _read_config(file: Path) -> dict | None:
    if not file.is_file():
        return None
    config = json.loads(file.read_text())
    name = config.get("_class_name", "AutoencoderKLFlux2")
    if name != "AutoencoderKLFlux2":
        raise VAEError(f"{file} describes a {name}, not AutoencoderKLFlux2 (the FLUX.2 VAE); "
                       f"MOSS-Image latents need the FLUX.2 VAE")
    return config


def _load_file(path: Path) -> AutoencoderKLFlux2:
    if path.suffix not in FILE_SUFFIXES:
        raise VAEError(f"{path} is not a .safetensors file; {WHAT}")
    sd = read_state_dict(path)
    config = _read_config(path.parent / "config.json")
    where = "the config.json beside it" if config is not None else (
        "the FLUX.2 VAE defaults (no config.json beside the file; put the VAE's config.json "
        "there if it is not the published FLUX.2 VAE)")
    cls = _flux2_class()
    allowed = set(inspect.signature(cls.__init__).parameters) - {"self"}
    with torch.device("meta"):
        model = cls(**{k: v for k, v in (config or {}).items() if k in allowed})
    if any(k.startswith(("encoder.down.", "decoder.up.")) for k in sd):
        sd = bfl_to_diffusers(sd, dict(model.config), str(path))
    sd.setdefault("bn.num_batches_tracked", torch.tensor(0, dtype=torch.long))
    expected = {k: v.shape for k, v in model.state_dict().items()}
    missing, unknown = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    if missing or unknown:
        parts = [f"{len(ks)} {what} keys (e.g. {', '.join(ks[:3])})"
                 for what, ks in (("missing", missing), ("unknown", unknown)) if ks]
        raise VAEError(f"{path} is not a FLUX.2 VAE matching {where}: {'; '.join(parts)}")
    bad = [f"{k} {list(sd[k].shape)} (expected {list(s)})" for k, s in expected.items()
           if sd[k].shape != s]
    if bad:
        raise VAEError(f"{path}: tensor shapes do not match {where}: {'; '.join(bad[:3])}"
                       f"{f' and {len(bad) - 3} more' if len(bad) > 3 else ''}")
    model.load_state_dict(sd, strict=True, assign=True)
    return model


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All VAE tensors of a single file, prefix stripped, ComfyUI-quantized ones dequantized,
    floating tensors in fp32. Keys under ``vae.`` / ``first_stage_model.`` are selected when
    present (so a full checkpoint's VAE part is found too)."""
    from kohakumoss.formats.reader import (CheckpointError, CheckpointFiles,
                                                     TransformerReader)
    try:
        reader = TransformerReader(CheckpointFiles(path, "file", [path], None))
    except CheckpointError:
        raise VAEError(f"{path} is not a readable safetensors file; {WHAT}") from None
    names = reader.names
    prefix = next((p for p in PREFIXES if any(n.startswith(p) for n in names)), "")
    out = {}
    for n in names:
        if n.startswith(prefix):
            t = reader.tensor(n)
            out[n[len(prefix):]] = t.float() if t.is_floating_point() else t
    return out


def _lift(key: str) -> str:
    """BFL nests the quant convs in the encoder / decoder; LDM and diffusers keep them on top."""
    for nested, top in (("encoder.quant_conv.", "quant_conv."),
                        ("decoder.post_quant_conv.", "post_quant_conv.")):
        if key.startswith(nested):
            return top + key[len(nested):]
    return key


def bfl_to_diffusers(sd: dict[str, torch.Tensor], config: dict, where: str = "state dict"
                     ) -> dict[str, torch.Tensor]:
    """Black Forest Labs / LDM VAE naming -> diffusers naming.

    Lifts ``encoder.quant_conv`` / ``decoder.post_quant_conv`` to the top, renames with
    diffusers' own LDM VAE converter (down/up blocks, mid block, 1x1-conv attention to
    linear) and keeps ``bn.*`` as is. Keys the converter does not use are an error.
    """
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
    lifted = {_lift(k): v for k, v in sd.items()}
    out = convert_ldm_vae_checkpoint({k: v for k, v in lifted.items() if not k.startswith("bn.")},
                                     config)
    out.update({k: v for k, v in lifted.items() if k.startswith("bn.")})
    used = {v.data_ptr() for v in out.values()}
    unused = sorted(k for k, v in lifted.items() if v.data_ptr() not in used)
    if unused:
        raise VAEError(f"{where}: {len(unused)} keys in BFL/LDM naming were not recognised "
                       f"(e.g. {', '.join(unused[:3])}); is this a FLUX.2 VAE?")
    return out
