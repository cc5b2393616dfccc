"""Latents and text embeddings of a host batch, from the caches or, on a miss, encoded.

``offline`` caches must hold every entry (a miss is an error naming it); ``online`` caches
encode a batch that misses and store it (returning exactly what a later hit will read);
``off`` encodes every batch. Encoders are loaded only when first needed.
"""

from __future__ import annotations

import torch

from kohakumoss.cache.lookup import BatchCaches
from kohakumoss.config import Params
from kohakumoss.data.loader import HostBatch


class BatchEncoder:
    def __init__(self, p: Params, caches: BatchCaches, device: torch.device):
        self.p, self.caches, self.device = p, caches, device
        self._vae = self._text = None

    def vae(self):
        if self._vae is None:
            from kohakumoss.encoders.vae import VAE

            self._vae = VAE.load(self.p.model.vae, dtype=self.p.encoders.vae_dtype, device=str(self.device))
        return self._vae

    def text_encoder(self):
        if self._text is None:
            from kohakumoss.encoders.text import TextEncoder

            e = self.p.encoders
            self._text = TextEncoder.load(self.p.model.text_encoder, tokenizer=self.p.model.tokenizer,
                                          dtype=e.text_dtype, device=str(self.device),
                                          stream=e.text_stream, precision=e.text_precision)
        return self._text

    def latents(self, batch: HostBatch) -> list[torch.Tensor]:
        hit = self.caches.read_latents(batch)
        if hit is not None:
            return hit
        e = self.p.encoders
        fresh = self.vae().encode_batches([px.to(self.device) for px in batch.pixels],
                                          max_pixels=e.vae_batch_pixels, batch=e.vae_batch,
                                          draw=e.draw)
        return self.caches.latents.write_back(self.caches.latent_keys(batch), [t.cpu() for t in fresh])

    def texts(self, batch: HostBatch) -> list[torch.Tensor]:
        hit = self.caches.read_text(batch)
        if hit is not None:
            return hit
        e = self.p.encoders
        fresh = self.text_encoder().encode(batch.captions, batch=e.text_batch, max_tokens=e.text_batch_tokens)
        return self.caches.text.write_back(self.caches.text_keys(batch), [t.cpu() for t in fresh])

    def flush(self) -> None:
        self.caches.flush()
