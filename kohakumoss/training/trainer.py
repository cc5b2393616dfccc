"""The training loop: plan-ordered batches -> cached latents/text -> flow loss -> optimiser
steps, with metrics, atomic checkpoints and an exact resume.

A run lives in ``runs/<name>/``: ``checkpoints/step-NNNNNN/`` (persisted), ``dvclive/``
(metrics and plots) and ``summary.json``. A killed run resumes from its newest complete
checkpoint the next time it starts: the plan is replayed from the next batch, sigmas and
noise are pure functions of (seed, batch), and the optimiser, schedule, EMA and RNG states
are restored, so the resumed run ends bit-identical to one that never stopped.

What runs (model and engines, trainable set, optimiser, caches, batches) is built first by
``kohakumoss.training.build.build_components``; this module only runs it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import torch

from kohakumoss import faults
from kohakumoss.artifacts import atomic_write_json, dir_lock, hash_json
from kohakumoss.config import Params, stage_params
from kohakumoss.data.loader import make_loader
from kohakumoss.configlib import ConfigError
from kohakumoss.parallel import barrier, reduce_sum
from kohakumoss.progress import progress as progress_bar
from kohakumoss.seeding import seed_of
from kohakumoss.diffusion.objective import flow_loss
from kohakumoss.formats.checkpoint import (archive_checkpoints, check_resumable, clean_partial,
                                            list_checkpoints, load_newest, save_checkpoint)
from kohakumoss.training.ahead import Ahead
from kohakumoss.training.build import Components, RunPaths, build_components
from kohakumoss.training.inputs import build_inputs
from kohakumoss.training.metrics import RunLog, rows_of

log = logging.getLogger(__name__)

# the params whose change makes an old checkpoint of the run unusable
RESUME_KEYS = ["model.transformer", "adapter", "optim", "objective", "train.dtype", "precision"]


@dataclasses.dataclass
class TrainResult:
    start_step: int
    end_step: int
    losses: list[float]
    skipped_steps: list[int]
    checkpoint: Path | None


class Trainer:
    """Runs a built run (``build_components``; built here when not given) from its newest
    good checkpoint to ``train.steps``."""

    def __init__(self, params: Params, paths: RunPaths, components: Components | None = None):
        c = components if components is not None else build_components(params, paths)
        self.params, self.paths, self.components = params, paths, c
        self.device, self.precision = c.device, c.engines.precision
        self.model, self.trainable = c.model, c.trainable
        # how gradients become the update (memory.optimizer, parallel): training/steppers.py
        self.stepper = c.stepper
        # how the ranks share the work, as it ran: a checkpoint resumes under the same
        self.parallel = "fsdp" if c.stepper.kind == "sharded" else "ddp" if c.dist.world > 1 else "single"
        self.optimizer, self.scheduler, self.ema = c.optimizer, c.scheduler, c.ema
        self.timesteps, self.caches, self.encoder, self.batches = (c.timesteps, c.caches,
                                                                   c.encoder, c.batches)
        # data parallel: this process's share of each step's micro-batches (kohakumoss.parallel)
        self.dist = c.dist
        ranks = params.parallel.world_size
        if ranks % self.dist.world:
            raise ConfigError(f"{params.path}: {self.dist.world} processes cannot share the plan's "
                              f"{ranks} ranks evenly; start parallel.world_size processes")
        self.micro_per_step = params.train.grad_accum * ranks // self.dist.world
        # what makes an old checkpoint of the run unusable: the data order, the training
        # params, what is trained, and what the caches encoded the data with (and to)
        self.identity = {"plan": c.plan.content_hash,
                         "params": hash_json(stage_params(params, RESUME_KEYS)),
                         "encoders": hash_json([c.caches.text_id, c.caches.vae_id,
                                                params.cache.dtype, params.encoders.draw,
                                                *c.caches.contents()]),
                         "trained": c.trainable.describe()}

    # -- state -------------------------------------------------------------------------------
    def _rng_state(self) -> dict[str, Any]:
        state = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def save(self, step: int, log: dict[str, Any] | None = None) -> Path | None:
        """Write the checkpoint of ``step``; ``log`` (the metrics so far) goes with it. A
        sharded run's ranks all gather the state; rank 0 writes it."""
        self.stepper.wait()  # an overlapped update still at work
        # the EMA's averages go to ema.safetensors only, its counters with the optimiser
        ema = {k: v for k, v in self.ema.state_dict().items() if k != "shadow"} if self.ema else None
        optimizer, state, shadow = self.stepper.trained_state()
        if not self.stepper.writes:
            return None
        extra = {"optimizer": optimizer, "scheduler": self.scheduler.state_dict(),
                 "ema": ema, "rng": self._rng_state()}
        scaler = self.stepper.scaler.state_dict()
        if scaler is not None:
            extra["scaler"] = scaler
        return save_checkpoint(self.paths.checkpoints, step, state, extra,
                               {**self.identity, "steps": self.params.train.steps,
                                "processes": self.dist.world, "parallel": self.parallel},
                               ema=shadow,
                               keep=self.params.train.keep_checkpoints,
                               metadata={"kohakumoss_state": "1",
                                         "kohakumoss_trained": str(self.identity["trained"])},
                               log=log)

    def resume(self) -> int:
        """Restore the newest good checkpoint (a damaged newer one is moved to
        ``runs/<name>/corrupt/`` with a warning) and return its step; 0 to start fresh."""
        self.resumed_rows: list[dict[str, Any]] = []  # the metric rows up to the resumed step
        # only rank 0 judges and moves checkpoints (partial writes, damaged ones, a finished
        # run of other params); after the barrier the others read, and never move, the newest
        # one it left: the one it resumes from, or none
        if self.dist.main:
            clean_partial(self.paths.checkpoints)
            found = load_newest(self.paths.checkpoints, self.paths.run / "corrupt")
            if found is not None and self._finished_elsewhere(found[0]):
                found = None
            barrier(self.dist)
        else:
            barrier(self.dist)
            found = load_newest(self.paths.checkpoints, None)
        if found is None:
            return 0
        ckpt, data = found
        check_resumable(ckpt, self.identity)
        made = ckpt.state.get("processes", 1)
        if made != self.dist.world:
            raise ConfigError(
                f"{ckpt.path} was written by a run of {made} process(es) and this one has "
                f"{self.dist.world}: a run resumes on as many as it started on (gradients are "
                f"summed in that order); start {made} (parallel.world_size: {made}), or move "
                f"{self.paths.checkpoints} aside to start over")
        written = ckpt.state.get("parallel", self.parallel)  # older checkpoints: as this run
        if written != self.parallel:
            raise ConfigError(
                f"{ckpt.path} was written under parallel.mode {written} and this run is "
                f"{self.parallel}: the optimizer states are laid out by the mode; resume with "
                f"parallel.mode: {written}, or move {self.paths.checkpoints} aside to start over")
        extra = data.extra
        self.stepper.load_trained(data.trainable, extra["optimizer"])  # a sharded run: its shard
        self.scheduler.load_state_dict(extra["scheduler"])
        if self.ema is not None and extra.get("ema") is not None and data.ema is not None:
            self.ema.load_state_dict({**extra["ema"], "shadow": data.ema})
        if extra.get("scaler") is not None:
            self.stepper.scaler.load_state_dict(extra["scaler"])
        torch.set_rng_state(extra["rng"]["torch"])
        if "cuda" in extra["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(extra["rng"]["cuda"])
        self.resumed_rows = rows_of(data.log)
        log.info("resuming from %s (step %d of %d)", ckpt.path, ckpt.step, self.params.train.steps)
        return ckpt.step

    def _finished_elsewhere(self, ckpt) -> bool:
        """Whether the newest checkpoint ended a run made with other params (a new
        experiment); if so its run's checkpoints are moved aside (rank 0) and this one starts
        fresh."""
        if ckpt.step < ckpt.state.get("steps", 0) or all(
                ckpt.state.get(k) == v for k, v in self.identity.items()):
            return False
        aside = archive_checkpoints(self.paths.checkpoints, self.paths.run / "history",
                                    f"{ckpt.state.get('plan', '')[:12]}-{ckpt.state.get('params', '')[:8]}")
        log.info("a finished run of other params was moved to %s; starting fresh", aside)
        return True

    # -- one optimiser step ----------------------------------------------------------------
    def make_inputs(self, batch, step: int):
        """A micro-batch's usable samples and their inputs on the device (``None``: none)."""
        keep = self.caches.usable(batch)
        if len(keep) < len(batch.captions):
            batch = batch.select(keep)
        if not batch.captions:
            return batch, None
        # keyed by the plan's global batch: the draws a single device would make for
        # these samples, on any number of processes
        return batch, build_inputs(batch, self.encoder.latents(batch), self.encoder.texts(batch),
                                   self.params, self.timesteps, batch.global_index, step,
                                   self.device, self.caches.masks(batch))

    def step(self, step: int, ahead: Ahead) -> tuple[float, float, bool, int]:
        """One optimiser step over the next ``micro_per_step`` micro-batches of ``ahead``:
        (the step's loss, its gradient norm, whether that was finite, its samples)."""
        n_tokens = self.batches.step_image_tokens(step)
        losses, samples = [], 0  # on the device until the step's end: no sync per micro-batch
        for micro in range(self.micro_per_step):
            batch, inputs = ahead.take()
            if inputs is not None:
                losses.append(self.micro_step(step, batch, inputs, n_tokens,
                                              micro == self.micro_per_step - 1))
                samples += len(batch.captions)
            ahead.prepare()  # the next micro-batch, while the device runs this backward
            if inputs is not None:
                self.stepper.after_backward()
        total = sum((float(v) for v in losses), 0.0)  # as floats, in micro-batch order
        self.stepper.reduce()
        total, samples = reduce_sum([total, samples], self.dist)
        grad_norm, finite = self.stepper.update(step)
        self.scheduler.step()
        return total, grad_norm, finite, int(samples)

    def micro_step(self, step: int, batch, inputs, n_tokens: int, last: bool) -> torch.Tensor:
        """One micro-batch's forward, loss and backward; returns its loss (on the device)."""
        p = self.params
        slot = batch.micro * p.parallel.world_size + batch.rank  # (micro-batch, rank)
        self.trainable.prepare_step(step, slot, inputs.sigma, inputs.layout)
        # dropout draws from torch's global RNG: make them a pure function of the step too
        torch.manual_seed(seed_of("dropout", p.run.seed, step, slot) & (2**63 - 1))
        with self.precision.autocast(self.device):
            pred = self.model(inputs.z, inputs.text, inputs.sigma, inputs.layout)
        loss = flow_loss(pred, inputs.target, inputs.loss_seg, inputs.weight, n_tokens,
                         p.objective.loss, p.objective.huber_delta, ops=self.components.applied.objective)
        self.stepper.backward(loss, last)
        return loss.detach()

    # -- the run -------------------------------------------------------------------------
    def run(self, progress: bool = True) -> TrainResult:
        """Train from the newest good checkpoint to ``train.steps`` (nothing to do for a
        finished run), holding the run's lock; always leaves dvclive/ and summary.json
        rebuilt from what the checkpoints persist."""
        if not self.dist.main:  # rank 0 holds the lock and writes everything
            return self._run(False)
        with dir_lock(self.paths.run, "kmoss train", wait=False):
            return self._run(progress)

    def _run(self, progress: bool) -> TrainResult:
        p = self.params
        start = self.resume()
        acc, steps = self.micro_per_step, p.train.steps
        main = self.dist.main
        self.model.train()
        # rank 0 keeps the metrics, previews, checkpoints and summary; the others only train
        self.log = RunLog(self.paths.run / "dvclive", self.paths.run / "previews",
                          self.resumed_rows, upto=start) if main else None
        previews = None
        # a sharded model's forward needs every rank: all preview, rank 0 keeps the images
        if (main or self.stepper.collective) and p.preview.every > 0 and p.preview.prompts and start < steps:
            from kohakumoss.training.previews import Previewer

            previews = Previewer(p, self.model, self.trainable, self.device,
                                 self.precision.compute)
            if start == 0:  # the untrained model's images: what the trained ones compare with
                with self.stepper.evaluating():
                    previews.run(0, self.log)
        validator = None  # the held-out images' loss (a sharded model: every rank evaluates)
        if (main or self.stepper.collective) and p.validation.every > 0 and start < steps:
            from kohakumoss.training.validation import Validator

            validator = Validator(self) or None
            if validator is None:
                log.warning("validation.every = %d but the plan holds no held-out image: set "
                            "validation.share or a dataset entry's validation: true",
                            p.validation.every)
            elif start == 0 and main:
                self.log.log(0, **validator.run(0))
        losses, skipped = [], []
        if start < steps:
            ahead = Ahead(iter(make_loader(self.batches, start=start * acc, end=steps * acc,
                                           num_workers=p.data.num_workers,
                                           prefetch=p.data.prefetch)),
                          self.make_inputs, start, acc)
        bar = progress_bar(steps, "train", "step", initial=start, enabled=progress)
        t0 = time.perf_counter()
        faults.point("train.start")
        for step in range(start, steps):
            loss, grad_norm, finite, samples = self.step(step, ahead)
            losses.append(loss)
            if not finite:
                skipped.append(step + 1)
                log.warning("step %d: non-finite gradient norm (%s); the update was skipped",
                            step + 1, grad_norm)
            dt = time.perf_counter() - t0
            t0 = time.perf_counter()
            held = validator.run(step + 1) if validator is not None and (
                validator.due(step + 1) or step + 1 == steps) else {}
            if held:  # the next step's samples/s leaves the evaluation out
                t0 = time.perf_counter()
            if main and ((step + 1) % p.train.log_every == 0 or step + 1 == steps or held):
                scale = {"loss_scale": self.stepper.scaler.scale} if self.stepper.scaler.scale else {}
                self.log.log(step + 1, loss=loss, lr=self.scheduler.get_last_lr()[0],
                             grad_norm=grad_norm, samples_per_s=samples / max(dt, 1e-9),
                             skipped=int(not finite), memory_gib=_memory_gib(self.device),
                             **scale, **held)
            bar.set_postfix({"loss": f"{loss:.4f}", "lr": f"{self.scheduler.get_last_lr()[0]:.2e}",
                             "samples/s": f"{samples / max(dt, 1e-9):.1f}",
                             "mem": f"{_memory_gib(self.device):.1f}G"})
            bar.update(1)
            if previews is not None and previews.due(step + 1):
                with self.stepper.evaluating():  # the weights a run evaluates (an average)
                    previews.run(step + 1, self.log)
            if (main or self.stepper.collective) and ((step + 1) % p.train.checkpoint_every == 0 or step + 1 == steps):
                self.encoder.flush()
                self.save(step + 1, self.log.state() if main else None)
            faults.point("train.step")
        bar.close()
        faults.point("train.finish")
        if not main:
            return TrainResult(start, steps, losses, skipped, None)
        self.log.close()
        ckpts = list_checkpoints(self.paths.checkpoints)
        last = ckpts[-1].path if ckpts else None
        rows = self.log.rows
        # a pure function of the checkpoints: the same after a resume, a no-op or a re-run
        atomic_write_json(self.paths.run / "summary.json", {
            "steps": steps, "final_loss": rows[-1].get("loss") if rows else None,
            "final_val_loss": next((r["val/loss"] for r in reversed(rows) if "val/loss" in r), None),
            "skipped_steps": [r["step"] for r in rows if r.get("skipped")],
            "checkpoint": last.name if last else None, **self.identity})
        return TrainResult(start, steps, losses, skipped, last)


def _memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return 0.0
