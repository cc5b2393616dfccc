"""The validation loss (``validation:``, ``docs/training.md#validation``).

The plan holds the held-out images' batches (``validation.parquet``: never trained on). Every
``validation.every`` steps each of them is evaluated at every noise level of
``validation.sigmas`` with noise that is a pure function of the run's seed and the image's
identity, with no graph, through the same model and engines as training: the flow loss per
image token, one figure per noise level (``val/loss_s0.30``) and their mean (``val/loss``).
Two runs of the same params, and a resumed run, see the same draws, so the figures differ
only where the weights do; unlike the training loss they do not move with each step's own
timesteps and noise.
"""

from __future__ import annotations

import copy
import logging
import time

import torch

from kohakumoss.data.batching import kept_token_indices
from kohakumoss.data.planfile import VALIDATION
from kohakumoss.diffusion.objective import flow_loss, noised
from kohakumoss.model import build_layout
from kohakumoss.seeding import seed_of
from kohakumoss.training.inputs import moved

log = logging.getLogger(__name__)

PREFIX = "val/"


def band_name(sigma: float) -> str:
    return f"{PREFIX}loss_s{sigma:.2f}"


def validation_noise(seed: int, uid: int, band: int, n: int, c: int) -> torch.Tensor:
    """The noise of held-out image ``uid`` at noise level ``band``: a pure function of both."""
    g = torch.Generator().manual_seed(seed_of("validation-noise", int(seed), int(uid), int(band)) & (2**63 - 1))
    return torch.randn(n, c, generator=g)


class Validator:
    """Evaluates the held-out batches of ``trainer``'s plan (see the module)."""

    def __init__(self, trainer):
        self.trainer = trainer
        p = trainer.params
        self.every, self.sigmas = p.validation.every, tuple(p.validation.sigmas)
        held = copy.copy(trainer.batches)  # the same data side, the held-out file, one process
        held.file, held.rank, held.world, held.plan_world = VALIDATION, 0, 1, 1
        held._cols = held._locators = None
        self.held = held
        self.batches = [held.batch(i) for i in range(len(held))]
        self.samples = sum(len(b.captions) for b in self.batches)

    def __bool__(self) -> bool:
        return self.samples > 0

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def run(self, step: int) -> dict[str, float]:
        """Each noise level's loss per image token over every held-out image, and their mean,
        with the weights the run evaluates (schedule-free's average: ``Stepper.evaluating``)."""
        with self.trainer.stepper.evaluating():
            return self._run(step)

    @torch.no_grad()
    def _run(self, step: int) -> dict[str, float]:
        t = self.trainer
        device = t.device
        t0 = time.perf_counter()
        was = t.model.training
        t.model.eval()  # dropout off: the weights alone decide the figures
        adapters = getattr(t.trainable, "adapters", None)  # its draws off, T-LoRA at full rank
        if adapters is not None:
            adapters.eval()
        sums = torch.zeros(len(self.sigmas), dtype=torch.float64)
        tokens = 0
        try:
            prepared = []
            for batch in self.batches:
                keep = t.caches.usable(batch)
                if len(keep) < len(batch.captions):
                    batch = batch.select(keep)
                if batch.captions:
                    prepared.append((batch, t.encoder.latents(batch), t.encoder.texts(batch)))
            prepared = [(b, *self._kept(b, lat, txt)) for b, lat, txt in prepared]
            tokens = sum(len(x) for _, latents, _, _ in prepared for x in latents)
            for band, sigma_value in enumerate(self.sigmas):
                for batch, latents, texts, keep in prepared:
                    sums[band] += float(self._loss(batch, latents, texts, keep, sigma_value, band,
                                                   tokens, device))
        finally:
            t.model.train(was)
            if adapters is not None:  # back on from the next step's prepare_step
                adapters.train(was)
        dt = time.perf_counter() - t0
        if not tokens:
            return {}
        values = {band_name(s): float(v) for s, v in zip(self.sigmas, sums.tolist())}
        values[PREFIX + "loss"] = float(sums.mean())
        log.info("step %d: validation loss %.5f over %d held-out images x %d noise levels "
                 "(%.2f s)", step, values[PREFIX + "loss"], self.samples, len(self.sigmas), dt)
        return values

    @staticmethod
    def _kept(batch, latents, texts):
        """The tokens the plan keeps of each image and caption (``batching.overlong``), as
        ``build_inputs`` keeps them."""
        lat, txt, keep = [], [], []
        for i, (h, w) in enumerate(batch.hw.tolist()):
            x = latents[i]
            idx = kept_token_indices(h * w, batch.img_keep[i], batch.keep_seed[i]) \
                if batch.img_keep[i] >= 0 else None
            lat.append(x[torch.from_numpy(idx)] if idx is not None else x)
            keep.append(idx)
            t = texts[i]
            txt.append(t[: batch.text_limit[i]] if batch.text_limit[i] >= 0 else t)
        return lat, txt, keep

    def _loss(self, batch, latents, texts, keep, sigma_value: float, band: int, n_tokens: int,
              device: torch.device) -> torch.Tensor:
        t = self.trainer
        p = t.params
        x0 = torch.cat([x.float() for x in latents])
        layout = build_layout(batch.hw.tolist(), [len(x) for x in texts], keep)
        eps = torch.cat([validation_noise(p.run.seed, int(u), band, len(x), x.shape[1])
                         for u, x in zip(batch.uids.tolist(), latents)])
        sigma = torch.full((len(latents),), float(sigma_value))
        z, target = noised(x0, eps, sigma[layout.seg_img])
        layout = layout.to(device)
        sigma_d = moved(sigma, device)
        t.trainable.prepare_step(0, 0, sigma_d, layout)
        with t.precision.autocast(device):
            pred = t.model(moved(z, device), moved(torch.cat(texts), device), sigma_d, layout)
        return flow_loss(pred, moved(target, device), layout.seg_img,
                         torch.ones(len(latents), device=device), n_tokens, p.objective.loss,
                         p.objective.huber_delta, ops=t.components.applied.objective)
