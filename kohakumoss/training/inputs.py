"""From a host batch to the model's packed inputs: latents and text (cached or encoded),
token dropping and text truncation as planned, sigmas, noise and the packed layout.

Sigmas and noise are pure functions of (seed, global batch index): a resumed run and an
uninterrupted one draw the same numbers, whatever the device (noise is drawn on the CPU).
"""

from __future__ import annotations

import dataclasses

import torch

from kohakumoss.config import Params
from kohakumoss.data.batching import kept_token_indices
from kohakumoss.data.loader import HostBatch
from kohakumoss.seeding import seed_of
from kohakumoss.diffusion.objective import noised, sigma_weight
from kohakumoss.diffusion.timesteps import batch_sigmas
from kohakumoss.model.layout import PackedLayout, build_layout, moved


@dataclasses.dataclass
class StepInputs:
    z: torch.Tensor  # [N_img, C] noised latents (fp32)
    target: torch.Tensor  # [N_img, C] velocity target (fp32)
    text: torch.Tensor  # [N_txt, T]
    sigma: torch.Tensor  # [B]
    layout: PackedLayout
    weight: torch.Tensor  # [B] loss weight x sigma weighting; [N_img] per token with a mask
    n_image_tokens: int
    loss_index: torch.Tensor | None = None  # the flow loss's weight index of each token:
    # its sample (None: layout.seg_img), or with a loss mask the token itself (weight per token)

    @property
    def loss_seg(self) -> torch.Tensor:
        return self.layout.seg_img if self.loss_index is None else self.loss_index


def noise_for(batch_index: int, seed: int, n: int, c: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed_of("noise", int(seed), int(batch_index)) & (2**63 - 1))
    return torch.randn(n, c, generator=g)


def build_inputs(batch: HostBatch, latents: list[torch.Tensor], texts: list[torch.Tensor],
                 p: Params, timesteps, global_batch: int, step: int,
                 device: torch.device | str,
                 masks: list[torch.Tensor | None] | None = None) -> StepInputs:
    """``latents[i]``: full-grid tokens [h*w, C] of sample i; ``texts[i]``: [L_i, T];
    ``masks[i]``: its loss mask [h*w] (None: unmasked), following the kept tokens."""
    tokens, keep, text_rows, kept_masks = [], [], [], []
    for i, (h, w) in enumerate(batch.hw.tolist()):
        x = latents[i]
        m = masks[i] if masks is not None and masks[i] is not None else torch.ones(h * w)
        if batch.img_keep[i] >= 0:
            idx = kept_token_indices(h * w, batch.img_keep[i], batch.keep_seed[i])
            keep.append(idx)
            x, m = x[torch.from_numpy(idx)], m[torch.from_numpy(idx)]
        else:
            keep.append(None)
        tokens.append(x.float())
        kept_masks.append(m.float())
        t = texts[i]
        if batch.text_limit[i] >= 0:
            t = t[: batch.text_limit[i]]
        text_rows.append(t)
    layout = build_layout(batch.hw.tolist(), [len(t) for t in text_rows], keep)
    x0 = torch.cat(tokens)
    sigma = batch_sigmas(timesteps, len(tokens), p.run.seed, global_batch, step)
    eps = noise_for(global_batch, p.run.seed, x0.shape[0], x0.shape[1])
    z, target = noised(x0, eps, sigma[layout.seg_img])
    o = p.objective
    weight = batch.loss_weight * sigma_weight(sigma, o.weighting, mean=o.weighting_mean,
                                              std=o.weighting_std, gamma=o.snr_gamma)
    index = None
    if masks is not None:  # each token weighted on its own: its sample's weight times its mask
        weight = weight[layout.seg_img] * torch.cat(kept_masks)
        index = moved(torch.arange(layout.n_img), device)
    return StepInputs(moved(z, device), moved(target, device),
                      moved(torch.cat(text_rows), device), moved(sigma, device), layout.to(device),
                      moved(weight, device), layout.n_img, index)



def make_timesteps(p: Params):
    from kohakumoss.diffusion.timesteps import (TECH_REPORT, LogitNormalTimesteps, MossTimesteps,
                                                UniformTimesteps)

    o = p.objective
    if o.timesteps == "moss":
        return MossTimesteps(mu=o.mu, s=o.s, cutoff=o.cutoff, uniform_mix=o.uniform_mix,
                           p_full=o.p_full, shift=o.shift,
                           schedule=TECH_REPORT if o.schedule == "tech_report" else ())
    if o.timesteps == "uniform":
        return UniformTimesteps(shift=o.shift)
    return LogitNormalTimesteps(mu=o.mu, s=o.s, shift=o.shift)
