"""Euler sampling with classifier-free guidance over packed batches
(``docs/diffusion.md#euler-sampler-with-cfg``).

Every image is a request: its text embedding, its negative embedding (the empty caption's
by default), its latent grid and its seed. Initial noise is drawn per image from its own
seed, on the CPU, in the shape ``[1, 128, h, w]`` and flattened row-major, so an image does
not depend on the batch it is sampled in, nor on the device. With ``cfg != 1`` the positive
and negative branches are packed into one forward (negatives skip the config's
``negative_skip_layers`` and keep their pre-block value there);
``v = u + cfg * (v_pos - u)`` in fp32; Euler steps on the shifted, grid-snapped schedule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from kohakumoss.diffusion.schedule import inference_sigmas
from kohakumoss.model.dit import MOSSImageTransformer
from kohakumoss.model.layout import build_layout


@dataclasses.dataclass
class Request:
    text: torch.Tensor  # [L, T] positive prompt embedding
    negative: torch.Tensor  # [L', T] negative (empty caption) embedding
    hw: tuple[int, int]  # latent grid (H/16, W/16)
    seed: int


def initial_noise(seed: int, hw: tuple[int, int], channels: int = 128) -> torch.Tensor:
    h, w = hw
    g = torch.Generator().manual_seed(int(seed))
    return torch.randn(1, channels, h, w, generator=g).flatten(2)[0].T.contiguous()


def velocity(model: MOSSImageTransformer, x: list[torch.Tensor], reqs: Sequence[Request],
             sigma: float, cfg: float, skip_layers: Sequence[int], device, dtype) -> list[torch.Tensor]:
    """The guided velocity of each request's current latent tokens (fp32)."""
    B = len(reqs)
    hw = [r.hw for r in reqs]
    texts = [r.text for r in reqs]
    skip = None
    if cfg != 1.0:
        hw, texts = hw + hw, texts + [r.negative for r in reqs]
        x = x + x
        skip = torch.tensor([False] * B + [True] * B)
    layout = build_layout(hw, [len(t) for t in texts]).to(device)
    z = torch.cat(x).to(device)
    text = torch.cat(texts).to(device=device, dtype=dtype)
    s = torch.full((len(hw),), sigma, dtype=torch.float32, device=device)
    with torch.no_grad():
        v = model(z.to(dtype), text, s, layout, skip_layers=skip_layers if skip is not None else (),
                  skip_samples=skip).float()
    parts = list(v.split(layout.img_len))
    if cfg == 1.0:
        return parts
    return [u + cfg * (p - u) for p, u in zip(parts[:B], parts[B:])]


def sample(model: MOSSImageTransformer, reqs: Sequence[Request], steps: int = 50, cfg: float = 3.0,
           shift: float = 5.0, skip_layers: Sequence[int] | None = None, device="cpu",
           dtype: torch.dtype = torch.float32, callback: Callable[[int, int], None] | None = None
           ) -> list[torch.Tensor]:
    """Latent tokens ``[h*w, 128]`` (fp32) of each request, sampled from its own noise."""
    skip = model.config.negative_skip_layers if skip_layers is None else tuple(skip_layers)
    bad = [n for n in skip if not 0 <= n < model.config.depth]
    if bad:
        raise ValueError(f"skip layers {bad} are outside [0, {model.config.depth})")
    sigmas = inference_sigmas(steps, shift).tolist()
    x = [initial_noise(r.seed, r.hw, model.config.latent_channels).to(device) for r in reqs]
    for i in range(len(sigmas) - 1):
        v = velocity(model, x, reqs, sigmas[i], cfg, skip, device, dtype)
        x = [xi + (sigmas[i + 1] - sigmas[i]) * vi for xi, vi in zip(x, v)]
        if callback:
            callback(i + 1, len(sigmas) - 1)
    return [xi.cpu() for xi in x]
