"""Preview images during training: fixed prompts and seeds every ``preview.every`` steps,
logged next to the metrics (DVCLive images) as single images and one grid.

The prompts are encoded once when training starts (the text encoder is loaded for that and
released); at a preview the live model samples in eval mode (adapter dropouts and T-LoRA
masks off), the VAE is loaded only to decode and released again, and the allocator's cached
blocks are returned before and after, so a preview does not push the run out of memory.
"""

from __future__ import annotations

import gc

import torch

from kohakumoss.config import Params
from kohakumoss.images import contact_sheet
from kohakumoss.diffusion.sampler import Request, sample


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Previewer:
    def __init__(self, p: Params, model, trainable, device: torch.device, dtype: torch.dtype):
        from kohakumoss.encoders.text import TextEncoder

        self.p, self.model, self.trainable = p, model, trainable
        self.device, self.dtype = device, dtype
        c = p.preview
        enc = TextEncoder.load(p.model.text_encoder, tokenizer=p.model.tokenizer,
                               dtype=p.encoders.text_dtype, device=str(device),
                               stream=p.encoders.text_stream,
                               precision=p.encoders.text_precision)
        embs = [e.cpu() for e in enc.encode(list(c.prompts) + [""])]
        del enc
        _release(device)
        self.texts, self.negative = embs[:-1], embs[-1]
        self.jobs = [(i, seed) for i in range(len(c.prompts)) for seed in c.seeds]

    def due(self, step: int) -> bool:
        c = self.p.preview
        return c.every > 0 and bool(c.prompts) and step % c.every == 0

    def run(self, step: int, metrics) -> list:
        from kohakumoss.encoders.vae import VAE

        c = self.p.preview
        hw = (c.height // 16, c.width // 16)
        _release(self.device)
        self.model.eval()
        set_eval = getattr(getattr(self.trainable, "adapters", None), "eval", None)
        if set_eval:
            set_eval()
        try:
            reqs = [Request(self.texts[i], self.negative, hw, seed) for i, seed in self.jobs]
            with torch.no_grad():
                latents = sample(self.model, reqs, c.steps, c.cfg, c.shift, device=self.device,
                                 dtype=self.dtype)
            vae = VAE.load(self.p.model.vae, dtype=self.p.encoders.vae_dtype, device=str(self.device))
            grid = torch.stack([t.T.reshape(-1, *hw) for t in latents]).to(self.device)
            pixels = vae.decode(grid).cpu()
            del vae
        finally:
            self.model.train()
            set_train = getattr(getattr(self.trainable, "adapters", None), "train", None)
            if set_train:
                set_train()
            _release(self.device)
        from PIL import Image

        images = [Image.fromarray(((px.permute(1, 2, 0) + 1) * 127.5).round().clamp(0, 255)
                                  .to(torch.uint8).numpy(), "RGB") for px in pixels]
        if metrics is None:  # a sharded run's other ranks: they only took part in the forward
            return images
        labels = [f"{seed}: {c.prompts[i]}" for i, seed in self.jobs]
        for (i, seed), img in zip(self.jobs, images):
            metrics.image(f"previews/step-{step:06d}/p{i}-s{seed}.png", img)
        metrics.image(f"previews/step-{step:06d}/grid.png", contact_sheet(images, labels,
                                                                          columns=len(c.seeds)))
        return images
