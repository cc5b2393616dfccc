"""Train examples/tiny-moss: the small MOSS-Image pipeline that the default run finetunes.

    python examples/make_demo_model.py [--out examples/tiny-moss] [--device cpu]

The embedded default must show that training works, so its components have to work too:
a VAE that encodes and decodes, and a base that draws what it is asked for. This script
makes both, in the real file layouts, so the default run loads them with the same code as
MOSS-Image's own weights (docs/demo.md):

1. ``vae/``: the FLUX.2 VAE architecture at the tiny widths (``kohakumoss.encoders.vae.
   TINY_CONFIG``), trained to reconstruct synthetic pictures (arbitrary colours, the example
   kinds in their palette and in kohaku style); its BatchNorm statistics are measured on the
   latents.
2. ``text_encoder/`` and ``tokenizer/``: the tiny Qwen3.5 (fixed random weights, the same
   as ``model.text_encoder: tiny``). A random encoder already gives every caption its own
   features; the base learns to read them.
3. ``transformer/``: the tiny DiT flavor, trained with the MOSS objective on pictures made by
   ``make_dataset.draw`` (shapes, stripes, gradients, captioned as tags) in colour, never in
   kohaku style and never with the word "kohaku": the concept the example dataset teaches
   (pictures in shades of amber, kohaku being Japanese for amber) is new to it.

The shipped weights are this script's defaults, run on 2 CPU cores (about 30 minutes;
deterministic on one device and thread count).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_dataset import draw, kohaku_style  # noqa: E402

from kohakumoss.diffusion.objective import noised  # noqa: E402
from kohakumoss.diffusion.timesteps import MossTimesteps  # noqa: E402
from kohakumoss.encoders.text import TextEncoder  # noqa: E402
from kohakumoss.encoders.vae import LATENT_ID, TINY_CONFIG, VAE, patchify, to_tokens  # noqa: E402
from kohakumoss.formats.model_files import save_official  # noqa: E402
from kohakumoss.model.build import tiny_transformer  # noqa: E402
from kohakumoss.model.config import FLAVORS  # noqa: E402
from kohakumoss.model.layout import build_layout  # noqa: E402

KINDS = ("shapes", "stripes", "gradients")
# near 192 x 192 (the default's target area) in steps of 16, as the plan's buckets are
SIZES = [(192, 192), (176, 208), (208, 176), (160, 224), (224, 160), (144, 256), (256, 144)]


def to_tensor(img: Image.Image) -> torch.Tensor:
    """An RGB picture -> ``[3, H, W]`` in [-1, 1]."""
    return torch.from_numpy(np.asarray(img.convert("RGB"), dtype=np.float32) / 127.5 - 1).permute(2, 0, 1)


def any_colour_picture(size: tuple[int, int], rng: np.random.Generator) -> Image.Image:
    """Rectangles, ellipses and bands in arbitrary colours: the VAE sees every colour."""
    w, h = size
    img = Image.new("RGB", size, tuple(int(c) for c in rng.integers(0, 256, 3)))
    d = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(1, 6))):
        x0, x1 = sorted(int(v) for v in rng.integers(-w // 4, w + w // 4, 2))
        y0, y1 = sorted(int(v) for v in rng.integers(-h // 4, h + h // 4, 2))
        fill = tuple(int(c) for c in rng.integers(0, 256, 3))
        (d.ellipse if rng.random() < 0.5 else d.rectangle)((x0, y0, x1 + 4, y1 + 4), fill=fill)
    return img


def warmup_cosine(opt, steps: int, warm: int):
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))


# ---- 1. the VAE -----------------------------------------------------------------------------

def vae_picture(rng: np.random.Generator, size: tuple[int, int], kind: int) -> Image.Image:
    """0: arbitrary colours; 1: the example kinds in their palette; 2: those in kohaku style."""
    if kind == 0:
        return any_colour_picture(size, rng)
    img, _ = draw(KINDS[int(rng.integers(3))], size, rng, alpha=False)
    return kohaku_style(img) if kind == 2 else img


def vae_batch(rng: np.random.Generator, n: int, crop: int) -> torch.Tensor:
    out = []
    for i in range(n):
        size = SIZES[int(rng.integers(len(SIZES)))]
        img = vae_picture(rng, size, i % 3)
        x, y = int(rng.integers(0, size[0] - crop + 1)), int(rng.integers(0, size[1] - crop + 1))
        out.append(to_tensor(img.crop((x, y, x + crop, y + crop))))
    return torch.stack(out)


@torch.no_grad()
def vae_error(vae, device: torch.device) -> dict[str, float]:
    """Mean absolute reconstruction error in 8-bit levels on fresh pictures of each kind."""
    rng = np.random.default_rng(17)
    out = {}
    for kind, name in enumerate(("any colour", "palette", "kohaku style")):
        x = torch.stack([to_tensor(vae_picture(rng, (192, 192), kind)) for _ in range(12)]).to(device)
        rec = vae.decode(vae.encode(x).latent_dist.mode()).sample.clamp(-1, 1)
        out[name] = round(float((rec - x).abs().mean()) * 127.5, 2)
    return out


def train_vae(steps: int, device: torch.device, log) -> torch.nn.Module:
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(1)
    vae = AutoencoderKLFlux2(**TINY_CONFIG).to(device).train()
    opt = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    sched = warmup_cosine(opt, steps, warm=50)
    rng = np.random.default_rng(11)
    t0 = time.time()
    for step in range(1, steps + 1):
        x = vae_batch(rng, 16, 64).to(device)
        dist = vae.encode(x).latent_dist
        rec = vae.decode(dist.sample()).sample
        loss = F.l1_loss(rec, x) + F.mse_loss(rec, x) + 1e-6 * dist.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps:
            log(f"vae {step}/{steps} loss={loss.item():.4f} ({time.time() - t0:.0f} s)")
    vae.eval()
    log(f"vae reconstruction error (8-bit levels): {vae_error(vae, device)}")
    return vae


@torch.no_grad()
def set_latent_statistics(vae, images: list[torch.Tensor], device: torch.device) -> None:
    """BatchNorm running statistics = the patchified latents' per-channel mean and variance."""
    ps = [patchify(vae.encode(x[None].to(device)).latent_dist.mode()).flatten(2)[0] for x in images]
    p = torch.cat(ps, dim=1).double()
    vae.bn.running_mean.copy_(p.mean(1).float())
    vae.bn.running_var.copy_(p.var(1).float())


# ---- 3. the base ----------------------------------------------------------------------------

def caption(tags: list[str], rng: np.random.Generator) -> str:
    """Tags shuffled, one dropped now and then, a tenth empty (for guidance), as the
    default run's captions are rendered."""
    if rng.random() < 0.1:
        return ""
    tags = [t for t in tags if rng.random() >= 0.1] or tags[:1]
    return ", ".join(tags[i] for i in rng.permutation(len(tags)))


@torch.no_grad()
def base_set(vae: VAE, enc: TextEncoder, count: int, log):
    """``count`` pictures as the normalised latent tokens the cache stages make, each with two
    caption renderings' embeddings."""
    rng = np.random.default_rng(7)
    latents, texts, hws = [], [], []
    for i in range(count):
        size = SIZES[i % len(SIZES)]
        img, tags = draw(KINDS[i % 3], size, rng, alpha=False)
        latents.append(to_tokens(vae.encode(to_tensor(img)[None]).cpu())[0])
        hws.append((size[1] // 16, size[0] // 16))
        texts.append(enc.encode([caption(tags, rng), caption(tags, rng)]))
        if (i + 1) % 500 == 0:
            log(f"encoded {i + 1}/{count} pictures")
    return latents, texts, hws


def train_base(latents, texts, hws, steps: int, batch: int, device: torch.device, log):
    torch.manual_seed(2)
    model = tiny_transformer().to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99))
    sched = warmup_cosine(opt, steps, warm=100)
    timesteps = MossTimesteps()
    g = torch.Generator().manual_seed(3)
    rng = np.random.default_rng(5)
    t0, avg = time.time(), None
    for step in range(1, steps + 1):
        idx = rng.choice(len(latents), batch, replace=False)
        x0 = torch.cat([latents[i] for i in idx]).to(device)
        txt = [texts[i][int(rng.integers(2))] for i in idx]
        layout = build_layout([hws[i] for i in idx], [len(t) for t in txt]).to(device)
        sigma = timesteps.sample(batch, g)
        sigma_N = sigma[layout.seg_img.cpu()].to(device)
        z, target = noised(x0, torch.randn(x0.shape, generator=g).to(device), sigma_N)
        pred = model(z, torch.cat(txt).to(device), sigma.to(device), layout)
        loss = F.mse_loss(pred.float(), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        avg = loss.item() if avg is None else 0.98 * avg + 0.02 * loss.item()
        if step % 100 == 0 or step == steps:
            log(f"base {step}/{steps} loss={avg:.4f} ({time.time() - t0:.0f} s)")
    return model.eval()


# ---- writing the pipeline folder ---------------------------------------------------------------

def save(out: Path, vae, enc: TextEncoder, model) -> None:
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "model_index.json").write_text(json.dumps({
        "_class_name": "MOSSImagePipeline", "_made_by": "examples/make_demo_model.py",
        "transformer": ["kohakumoss", "MOSSImageTransformer"],
        "text_encoder": ["transformers", "Qwen3_5TextModel"],
        "tokenizer": ["transformers", "Qwen2TokenizerFast"],
        "vae": ["diffusers", "AutoencoderKLFlux2"]}, indent=2) + "\n")
    save_official(model.cpu().state_dict(), tmp / "transformer", FLAVORS["tiny"], dtype=torch.float32)
    enc.model.save_pretrained(tmp / "text_encoder")
    enc.tokenizer.save_pretrained(tmp / "tokenizer")
    vae.cpu().save_pretrained(tmp / "vae")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "tiny-moss")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vae-steps", type=int, default=3000)
    ap.add_argument("--base-steps", type=int, default=6000)
    ap.add_argument("--pictures", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vae", type=Path, help="reuse this trained vae/ folder (skips step 1)")
    a = ap.parse_args()
    device = torch.device(a.device)
    torch.use_deterministic_algorithms(True, warn_only=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    if a.vae is not None:
        from diffusers import AutoencoderKLFlux2

        vae = AutoencoderKLFlux2.from_pretrained(a.vae).to(device).eval()
    else:
        vae = train_vae(a.vae_steps, device, log)
        rng = np.random.default_rng(13)
        stats_images = [to_tensor(draw(KINDS[i % 3], SIZES[i % len(SIZES)], rng, alpha=False)[0])
                        for i in range(96)]
        set_latent_statistics(vae, stats_images, device)
    enc = TextEncoder.load("tiny", dtype="fp32", device=str(device))
    latents, texts, hws = base_set(VAE(vae, torch.float32, device, LATENT_ID), enc, a.pictures, log)
    model = train_base(latents, texts, hws, a.base_steps, a.batch, device, log)
    save(a.out, vae, enc, model)
    log(f"wrote {a.out}")


if __name__ == "__main__":
    main()
