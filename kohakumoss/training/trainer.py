"""The training loop: plan-ordered batches -> cached latents/text -> flow loss -> optimiser
steps, with metrics, atomic checkpoints and an exact resume.

A run lives in ``runs/<name>/``: ``checkpoints/step-NNNNNN/`` (persisted), ``dvclive/``
(metrics and plots) and ``summary.json``. A killed run resumes from its newest complete
checkpoint the next time it starts: the plan is replayed from the next batch, sigmas and
noise are pure functions of (seed, batch), and the optimiser, schedule, EMA and RNG states
are restored, so the resumed run ends bit-identical to one that never stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from kohakumoss import faults
from kohakumoss.artifacts import atomic_write_json, dir_lock, hash_json
from kohakumoss.cache.build import text_identity, vae_identity
from kohakumoss.cache.lookup import BatchCaches
from kohakumoss.config import Params, stage_params
from kohakumoss.data.catalogset import load_catalogs
from kohakumoss.data.loader import PlanBatches, make_loader
from kohakumoss.data.planfile import read_plan
from kohakumoss.seeding import seed_of
from kohakumoss.diffusion.objective import flow_loss
from kohakumoss.device import resolve_device
from kohakumoss.precision import DTYPES
from kohakumoss.formats import load_dit
from kohakumoss.training.checkpoint import (archive_checkpoints, check_resumable, clean_partial,
                                            list_checkpoints, load_newest, save_checkpoint)
from kohakumoss.training.ema import EMA
from kohakumoss.training.encode import BatchEncoder
from kohakumoss.training.inputs import build_inputs, make_timesteps
from kohakumoss.training.metrics import RunLog, rows_of
from kohakumoss.training.optim import build_optimizer, build_scheduler, clip_and_check
from kohakumoss.training.trainable import make_trainable

log = logging.getLogger(__name__)

# the params whose change makes an old checkpoint of the run unusable
RESUME_KEYS = ["model.transformer", "adapter", "optim", "objective", "train.dtype"]


@dataclasses.dataclass
class RunPaths:
    plan: Path
    catalog: Path
    text_cache: Path
    latent_cache: Path
    run: Path

    @property
    def checkpoints(self) -> Path:
        return self.run / "checkpoints"


@dataclasses.dataclass
class TrainResult:
    start_step: int
    end_step: int
    losses: list[float]
    skipped_steps: list[int]
    checkpoint: Path | None


class Trainer:
    def __init__(self, p: Params, paths: RunPaths):
        self.p, self.paths = p, paths
        self.device = resolve_device(p.train.device)
        self.dtype = DTYPES[p.train.dtype]
        self.plan_table, self.plan = read_plan(paths.plan)
        full = p.adapter.full
        # full finetune: fp32 master weights, bf16 compute by autocast; adapters: the frozen
        # base in the compute dtype, the adapter in fp32
        self.model = load_dit(p.model.transformer, torch.float32 if full else self.dtype, self.device)
        self.trainable = make_trainable(self.model, p)
        named = self.trainable.named_parameters()
        self.params = [q for _, q in named]
        self.optimizer = build_optimizer(named, p.optim, self.trainable.lr_scale())
        self.scheduler = build_scheduler(self.optimizer, p.optim, p.train.steps)
        self.ema = EMA(named, p.optim.ema, device=self.device) if p.optim.ema > 0 else None
        self.timesteps = make_timesteps(p)
        cs = load_catalogs(paths.catalog, p.data.datasets)
        self.caches = BatchCaches(p, cs, paths.text_cache, paths.latent_cache,
                                  text_identity(p), vae_identity(p))
        self.encoder = BatchEncoder(p, self.caches, self.device)
        self.batches = PlanBatches(paths.plan, p.data.datasets, p.resolution, paths.catalog,
                                   pixels=p.cache.latents != "offline",
                                   max_pixels=p.data.max_image_pixels)
        # what makes an old checkpoint of the run unusable: the data order, the training
        # params, what is trained, and what the caches encoded the data with
        self.identity = {"plan": self.plan.content_hash,
                         "params": hash_json(stage_params(p, RESUME_KEYS)),
                         "encoders": hash_json([self.caches.text_id, self.caches.vae_id,
                                                p.cache.dtype, p.encoders.draw]),
                         "trained": self.trainable.describe()}

    # -- state -------------------------------------------------------------------------------
    def _rng_state(self) -> dict[str, Any]:
        state = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def save(self, step: int, log: dict[str, Any] | None = None) -> Path:
        """Write the checkpoint of ``step``; ``log`` (the metrics so far) goes with it."""
        # the EMA's averages go to ema.safetensors only, its counters with the optimiser
        ema = {k: v for k, v in self.ema.state_dict().items() if k != "shadow"} if self.ema else None
        extra = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "ema": ema, "rng": self._rng_state()}
        return save_checkpoint(self.paths.checkpoints, step, self.trainable.state_dict(), extra,
                               {**self.identity, "steps": self.p.train.steps},
                               ema=self.ema.shadow if self.ema else None,
                               keep=self.p.train.keep_checkpoints,
                               metadata={"kohakumoss_state": "1",
                                         "kohakumoss_trained": str(self.identity["trained"])},
                               log=log)

    def resume(self) -> int:
        """Restore the newest good checkpoint (a damaged newer one is moved to
        ``runs/<name>/corrupt/`` with a warning) and return its step; 0 to start fresh."""
        clean_partial(self.paths.checkpoints)
        self.resumed_rows: list[dict[str, Any]] = []  # the metric rows up to the resumed step
        found = load_newest(self.paths.checkpoints, self.paths.run / "corrupt")
        if found is None:
            return 0
        ckpt, data = found
        if ckpt.step >= ckpt.state.get("steps", 0) and any(
                ckpt.state.get(k) != v for k, v in self.identity.items()):
            # the newest checkpoint ended a run made with other params (a new experiment):
            # keep that run's checkpoints aside and start fresh
            aside = archive_checkpoints(self.paths.checkpoints, self.paths.run / "history",
                                        f"{ckpt.state.get('plan', '')[:12]}-{ckpt.state.get('params', '')[:8]}")
            log.info("a finished run of other params was moved to %s; starting fresh", aside)
            return 0
        check_resumable(ckpt, self.identity)
        self.trainable.load_state_dict(data.trainable)
        extra = data.extra
        self.optimizer.load_state_dict(extra["optimizer"])
        self.scheduler.load_state_dict(extra["scheduler"])
        if self.ema is not None and extra.get("ema") is not None and data.ema is not None:
            self.ema.load_state_dict({**extra["ema"], "shadow": data.ema})
        torch.set_rng_state(extra["rng"]["torch"])
        if "cuda" in extra["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(extra["rng"]["cuda"])
        self.resumed_rows = rows_of(data.log)
        log.info("resuming from %s (step %d of %d)", ckpt.path, ckpt.step, self.p.train.steps)
        return ckpt.step

    # -- one optimiser step ----------------------------------------------------------------
    def _autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def step(self, step: int, micro_batches: list) -> tuple[float, float, bool, int]:
        p = self.p
        n_tokens = self.batches.step_image_tokens(step)
        total, samples = 0.0, 0
        for micro, batch in enumerate(micro_batches):
            keep = self.caches.usable(batch)
            if len(keep) < len(batch.captions):
                batch = batch.select(keep)
            if not batch.captions:
                continue
            g = batch.index * p.parallel.world_size + batch.rank
            inputs = build_inputs(batch, self.encoder.latents(batch), self.encoder.texts(batch), p,
                                  self.timesteps, g, step, self.device)
            self.trainable.prepare_step(step, micro, inputs.sigma, inputs.layout)
            # dropout draws from torch's global RNG: make them a pure function of the step too
            torch.manual_seed(seed_of("dropout", p.run.seed, step, micro) & (2**63 - 1))
            with self._autocast():
                pred = self.model(inputs.z, inputs.text, inputs.sigma, inputs.layout)
            loss = flow_loss(pred, inputs.target, inputs.layout.seg_img, inputs.weight, n_tokens,
                             p.objective.loss, p.objective.huber_delta)
            loss.backward()
            total += float(loss.detach())
            samples += len(batch.captions)
        grad_norm, finite = clip_and_check(self.params, p.optim.grad_clip)
        if finite:
            self.optimizer.step()
            if self.ema is not None:
                self.ema.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return total, grad_norm, finite, samples

    # -- the run -------------------------------------------------------------------------
    def run(self, progress: bool = True) -> TrainResult:
        """Train from the newest good checkpoint to ``train.steps`` (nothing to do for a
        finished run), holding the run's lock; always leaves dvclive/ and summary.json
        rebuilt from what the checkpoints persist."""
        with dir_lock(self.paths.run, "kmoss train", wait=False):
            return self._run(progress)

    def _run(self, progress: bool) -> TrainResult:
        p = self.p
        start = self.resume()
        acc, steps = p.train.grad_accum, p.train.steps
        self.model.train()
        self.log = RunLog(self.paths.run / "dvclive", self.paths.run / "previews",
                          self.resumed_rows, upto=start)
        previews = None
        if p.preview.every > 0 and p.preview.prompts and start < steps:
            from kohakumoss.training.previews import Previewer

            previews = Previewer(p, self.model, self.trainable, self.device, self.dtype)
        losses, skipped = [], []
        if start < steps:
            loader = iter(make_loader(self.batches, start=start * acc, end=steps * acc,
                                      num_workers=p.data.num_workers, prefetch=p.data.prefetch))
        bar = tqdm(total=steps, initial=start, desc="train", unit="step",
                   disable=None if progress else True)
        t0 = time.perf_counter()
        faults.point("train.start")
        for step in range(start, steps):
            micro = [next(loader) for _ in range(acc)]
            loss, grad_norm, finite, samples = self.step(step, micro)
            losses.append(loss)
            if not finite:
                skipped.append(step + 1)
                log.warning("step %d: non-finite gradient norm (%s); the update was skipped",
                            step + 1, grad_norm)
            dt = time.perf_counter() - t0
            t0 = time.perf_counter()
            if (step + 1) % p.train.log_every == 0 or step + 1 == steps:
                self.log.log(step + 1, loss=loss, lr=self.scheduler.get_last_lr()[0],
                             grad_norm=grad_norm, samples_per_s=samples / max(dt, 1e-9),
                             skipped=int(not finite), memory_gib=_memory_gib(self.device))
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{self.scheduler.get_last_lr()[0]:.2e}",
                            sps=f"{samples / max(dt, 1e-9):.1f}",
                            mem=f"{_memory_gib(self.device):.1f}G")
            bar.update(1)
            if previews is not None and previews.due(step + 1):
                previews.run(step + 1, self.log)
            if (step + 1) % p.train.checkpoint_every == 0 or step + 1 == steps:
                self.encoder.flush()
                self.save(step + 1, self.log.state())
            faults.point("train.step")
        bar.close()
        faults.point("train.finish")
        self.log.close()
        ckpts = list_checkpoints(self.paths.checkpoints)
        last = ckpts[-1].path if ckpts else None
        rows = self.log.rows
        # a pure function of the checkpoints: the same after a resume, a no-op or a re-run
        atomic_write_json(self.paths.run / "summary.json", {
            "steps": steps, "final_loss": rows[-1].get("loss") if rows else None,
            "skipped_steps": [r["step"] for r in rows if r.get("skipped")],
            "checkpoint": last.name if last else None, **self.identity})
        return TrainResult(start, steps, losses, skipped, last)


def _memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return 0.0
