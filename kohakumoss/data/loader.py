"""Materialise planned batches into host batches, in plan order, on worker processes.

``docs/data.md#loader``. A host batch holds, per sample, the decoded pixels (EXIF
orientation, crop box, alpha over the background colour, RGB, resample to the target,
flip) as float32 ``[3, H, W]`` in the VAE's input range ``[-1, 1]``, the caption to encode
(``""`` when the plan dropped the text) and the plan's bookkeeping. The batch stream is a
pure function of the plan: worker ``w`` of ``W`` materialises local indices
``start + w, start + w + W, ...`` and the DataLoader's round-robin collection returns them
in index order, so any worker count, and any resume position ``start``, yields exactly the
batches an uninterrupted run would have.

A sample whose image cannot be decoded is left out of its batch with a warning and listed
in ``HostBatch.skipped``; it never stops the run.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import multiprocessing
import os
import select
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from PIL import Image, ImageOps

from kohakumoss import portable
from kohakumoss.config import DatasetEntry, ResolutionConfig
from kohakumoss.data.rows import MAX_IMAGE_PIXELS
from kohakumoss.data.sources.images import ALPHA_MODES, open_image

log = logging.getLogger(__name__)

BACKGROUNDS = {"white": (255, 255, 255), "black": (0, 0, 0), "gray": (127, 127, 127)}
RESAMPLE = {"lanczos": Image.Resampling.LANCZOS, "bicubic": Image.Resampling.BICUBIC,
            "bilinear": Image.Resampling.BILINEAR, "box": Image.Resampling.BOX}


def background_rgb(bg: str | tuple[int, int, int]) -> tuple[int, int, int]:
    return BACKGROUNDS[bg] if isinstance(bg, str) else tuple(bg)


def decode_image(data: bytes, box: tuple[int, int, int, int], target_hw: tuple[int, int],
                 flip: bool, background: str | tuple[int, int, int] = "white",
                 resample: str = "lanczos", max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """Decode one planned sample to uint8 ``[H, W, 3]`` (``docs/data.md#decoding``). A header
    declaring more than ``max_pixels`` (a file swapped for a decompression bomb after the
    scan) is a ``ValueError`` before any pixel is decoded."""
    with open_image(io.BytesIO(data), max_pixels) as im:
        im = ImageOps.exif_transpose(im)
        im = im.crop(box)
        if im.mode in ALPHA_MODES or (im.mode == "P" and "transparency" in im.info):
            rgba = im.convert("RGBA")
            canvas = Image.new("RGBA", rgba.size, (*background_rgb(background), 255))
            im = Image.alpha_composite(canvas, rgba)
        im = im.convert("RGB")
        th, tw = target_hw
        if im.size != (tw, th):
            im = im.resize((tw, th), RESAMPLE[resample], reducing_gap=3.0)
        if flip:
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return np.asarray(im, dtype=np.uint8).copy()


def to_model_range(pixels_hwc: np.ndarray) -> torch.Tensor:
    """uint8 ``[H, W, 3]`` -> float32 ``[3, H, W]`` with ``x / 127.5 - 1``."""
    return torch.from_numpy(pixels_hwc).permute(2, 0, 1).float() / 127.5 - 1.0


@dataclasses.dataclass
class HostBatch:
    index: int
    rank: int
    step: int
    micro: int
    uids: torch.Tensor  # int64 [B]
    hw: torch.Tensor  # int32 [B, 2] latent grid (h/16, w/16)
    pixels: list[torch.Tensor]  # float32 [3, H, W] in [-1, 1]
    captions: list[str]  # "" where text_drop
    text_drop: torch.Tensor  # bool [B]
    loss_weight: torch.Tensor  # float32 [B]
    text_limit: list[int]  # -1 = none
    img_keep: list[int]  # -1 = none
    keep_seed: list[int]
    crops: list[tuple[int, int, int, int]]
    flips: list[bool]
    skipped: list[tuple[int, str]]
    global_index: int = -1  # the plan's global batch g (rank = g % the plan's world size)

    def select(self, keep: list[int]) -> HostBatch:
        """The batch restricted to the samples at positions ``keep``."""
        idx = torch.tensor(keep, dtype=torch.int64)
        pick = lambda xs: [xs[i] for i in keep]  # noqa: E731
        return dataclasses.replace(
            self, uids=self.uids[idx], hw=self.hw[idx], pixels=pick(self.pixels) if self.pixels else [],
            captions=pick(self.captions), text_drop=self.text_drop[idx],
            loss_weight=self.loss_weight[idx], text_limit=pick(self.text_limit),
            img_keep=pick(self.img_keep), keep_seed=pick(self.keep_seed), crops=pick(self.crops),
            flips=pick(self.flips))


class PlanBatches:
    """Random access to the plan's batches of one process (one rank's, or with ``world`` 1
    every rank's); picklable, opens files lazily."""

    def __init__(self, plan_dir: str | Path, datasets: tuple[DatasetEntry, ...],
                 resolution: ResolutionConfig, catalog_dir: str | Path, rank: int = 0,
                 world: int = 1, pixels: bool = True, max_pixels: int = MAX_IMAGE_PIXELS,
                 plan_world: int | None = None, file: str = "plan.parquet"):
        self.plan_dir = Path(plan_dir)
        self.file = file  # validation.parquet: the held-out batches
        self.catalog_dir = Path(catalog_dir)
        self.datasets = datasets
        self.resolution = resolution
        # this process takes global batches index * world + rank; the plan was made for
        # plan_world ranks (a batch's rank is the plan's; one process may read them all)
        self.rank, self.world = rank, world
        self.plan_world = world if plan_world is None else plan_world
        self.pixels = pixels  # False: the latents come from an offline cache, decode nothing
        self.max_pixels = max_pixels  # data.max_image_pixels: the scan's limit holds here too
        self._cols: dict[str, np.ndarray] | None = None
        self._locators: list[list[str]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cols": None, "_locators": None}

    def _load(self) -> dict[str, np.ndarray]:
        if self._cols is None:
            table = pq.read_table(self.plan_dir / self.file)
            cols = {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names}
            last = int(cols["batch"][-1]) if len(cols["batch"]) else -1
            starts = np.searchsorted(cols["batch"], np.arange(last + 2))
            cols["_starts"] = starts
            self._cols = cols
        return self._cols

    def _locator(self, dataset: int, row: int) -> str:
        if self._locators is None:
            import json

            from kohakumoss.data.catalog import read_catalog

            index = json.loads((self.catalog_dir / "index.json").read_text(encoding="utf-8"))
            self._locators = [read_catalog(self.catalog_dir / e["catalog"]).column("locator")
                              .to_pylist() for e in index]
        return self._locators[dataset][row]

    def step_image_tokens(self, step: int) -> int:
        """Planned loss tokens of optimiser step ``step`` over all micro-batches and ranks."""
        cols = self._load()
        return int(cols["image_tokens"][cols["step"] == step].sum())

    def __len__(self) -> int:
        n_global = len(self._load()["_starts"]) - 1
        return max(0, (n_global - self.rank + self.world - 1) // self.world)

    def batch(self, index: int) -> HostBatch:
        cols = self._load()
        g = index * self.world + self.rank
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} is outside the plan ({len(self)} batches for rank "
                             f"{self.rank}); the run is longer than its plan: re-run `kmoss plan`")
        lo, hi = int(cols["_starts"][g]), int(cols["_starts"][g + 1])
        res = self.resolution
        out: dict[str, list] = {k: [] for k in ("uids", "hw", "pixels", "captions", "text_drop",
                                                "loss_weight", "text_limit", "img_keep",
                                                "keep_seed", "crops", "flips")}
        skipped = []
        for i in range(lo, hi):
            d, row, uid = int(cols["dataset"][i]), int(cols["row"][i]), int(cols["uid"][i])
            box = tuple(int(cols[k][i]) for k in ("crop_l", "crop_t", "crop_r", "crop_b"))
            th, tw = int(cols["target_h"][i]), int(cols["target_w"][i])
            flip = bool(cols["flip"][i])
            locator = self._locator(d, row)
            if self.pixels:
                try:
                    data = self.datasets[d].args.open(locator)
                    pix = decode_image(data, box, (th, tw), flip, res.background, res.resample,
                                       self.max_pixels)
                except Exception as e:  # a broken file is reported and skipped, never fatal
                    reason = f"{type(e).__name__}: {e}"
                    log.warning("batch %d: skipping dataset %d image %s (%s)", index, d, locator, reason)
                    skipped.append((uid, f"{locator}: {reason}"))
                    continue
                out["pixels"].append(to_model_range(pix))
            drop = bool(cols["text_drop"][i])
            out["uids"].append(uid)
            out["hw"].append((th // 16, tw // 16))
            out["captions"].append("" if drop else str(cols["caption"][i]))
            out["text_drop"].append(drop)
            out["loss_weight"].append(float(cols["loss_weight"][i]))
            out["text_limit"].append(int(cols["text_limit"][i]))
            out["img_keep"].append(int(cols["img_keep"][i]))
            out["keep_seed"].append(int(cols["keep_seed"][i]))
            out["crops"].append(box)
            out["flips"].append(flip)
        return HostBatch(
            index=index, rank=g % self.plan_world, step=int(cols["step"][lo]), micro=int(cols["micro"][lo]),
            uids=torch.tensor(out["uids"], dtype=torch.int64),
            hw=torch.tensor(out["hw"], dtype=torch.int32).reshape(-1, 2),
            pixels=out["pixels"], captions=out["captions"],
            text_drop=torch.tensor(out["text_drop"], dtype=torch.bool),
            loss_weight=torch.tensor(out["loss_weight"], dtype=torch.float32),
            text_limit=out["text_limit"], img_keep=out["img_keep"], keep_seed=out["keep_seed"],
            crops=out["crops"], flips=out["flips"], skipped=skipped, global_index=g)


class PlanStream(torch.utils.data.IterableDataset):
    """Local batches ``start .. end-1`` of one rank, split round-robin over workers."""

    def __init__(self, batches: PlanBatches, start: int = 0, end: int | None = None):
        super().__init__()
        self.batches, self.start = batches, start
        self.end = len(batches) if end is None else min(end, len(batches))

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for index in range(self.start + wid, self.end, nw):
            yield self.batches.batch(index)


def make_loader(batches: PlanBatches, start: int = 0, end: int | None = None,
                num_workers: int = 2, prefetch: int = 2) -> torch.utils.data.DataLoader:
    """A DataLoader yielding ``HostBatch``es in plan order from local index ``start``."""
    kwargs: dict[str, Any] = {}
    if num_workers > 0:
        kwargs = {"multiprocessing_context": multiprocessing.get_context(portable.worker_start()),
                  "prefetch_factor": prefetch}
    # an own generator: creating the iterator must not draw from torch's global RNG, whose
    # state a resumed run restores (dropout draws depend on it)
    return torch.utils.data.DataLoader(PlanStream(batches, start, end), batch_size=None,
                                       num_workers=num_workers, collate_fn=_identity,
                                       worker_init_fn=functools.partial(_die_with_trainer,
                                                                        os.getpid()),
                                       generator=torch.Generator().manual_seed(0), **kwargs)


def _die_with_trainer(trainer: int, worker_id: int) -> None:
    """End this worker when the trainer (pid ``trainer``) dies, e.g. by ``kill -9``.

    Workers are forked by the forkserver, not by the trainer, and hold the forkserver open:
    neither torch's watchdog (which watches the worker's parent) nor ``PR_SET_PDEATHSIG``
    sees the trainer go, so a killed run would leave both behind for good. A daemon
    thread waits on the trainer's pidfd (Linux 5.3+; a one-second poll elsewhere, and for
    spawned workers, ``portable.worker_start``).
    """
    import threading

    def watch() -> None:
        try:
            fd = portable.pidfd_open(trainer)
        except ProcessLookupError:
            os._exit(1)
        if fd is None:  # no pidfd: poll
            while portable.pid_alive(trainer):
                time.sleep(1.0)
            os._exit(1)
        select.select([fd], [], [])  # readable once the trainer has exited
        os._exit(1)

    threading.Thread(target=watch, name="kmoss-trainer-watch", daemon=True).start()


def _identity(x):
    return x
