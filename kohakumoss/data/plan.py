"""The sampling plan: every batch of the whole run, a pure function of (catalogs, seed, knobs).

``docs/data.md#the-plan``, with this project's order of stages: the plan (not the trainer)
fixes target sizes, crops, flips, caption renderings and text-drop decisions, so the cache
stages encode exactly what training will read. Per epoch ``e``:

1. epoch order from ``("epoch-order", seed, e)``: whole repeats plus one float32 Bernoulli
   draw per row for the fractional weight, then a permutation;
2. per occurrence ``("item", seed, e, position, uid)``: crop position (random crop only),
   flip (when enabled), caption variant;
3. over-long fit (drop / truncate_text / drop_tokens) against ``max_tokens``;
4. batching (greedy tokens, first-fit-decreasing windows, or fixed count) per stream (one
   stream, or one per target size in bucket mode), then ``("batch-order", seed, e)``
   shuffles the batches when bucket-grouped or FFD.

Epochs are planned until ``steps * grad_accum * world_size`` global batches exist; global
batch ``g`` is local batch ``g // world`` of rank ``g % world``. Text dropout is decided
per slot from ``("text-drop", seed, index, rank, slot)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from kohakumoss.config import Params
from kohakumoss.data.batching import fit_overlong, keep_seed, pack_count, pack_ffd, pack_greedy
from kohakumoss.data.captions import estimate_text_tokens, render_caption
from kohakumoss.data.catalogset import CatalogSet
from kohakumoss.data.resolution import Resolver
from kohakumoss.seeding import rng_of, seed_of
from kohakumoss.errors import KohakuError
from kohakumoss.progress import progress as progress_bar


class PlanError(KohakuError, RuntimeError):
    """The data and knobs cannot yield the planned run (empty epoch, nothing fits)."""


@dataclasses.dataclass
class Occurrence:
    epoch: int
    position: int
    row: int  # concatenated catalog position
    target: tuple[int, int]  # (h, w)
    box: tuple[int, int, int, int]  # (l, t, r, b)
    flip: bool
    variant: int
    caption: str | None = None
    image_tokens: int = 0
    text_tokens: int = 0
    text_limit: int = -1
    img_keep: int = -1
    keep_seed: int = 0


@dataclasses.dataclass
class EpochResult:
    batches: list[list[Occurrence]]
    items: int
    dropped: int
    fitted: int
    unbatched: int


def budget_mode(p: Params) -> str:
    mode = p.batching.token_budget
    if mode == "auto":
        return "exact" if p.caption.tokenizer else "estimate"
    return mode


class Planner:
    """Plans epochs lazily; ``plan_batches(n)`` returns the first ``n`` global batches."""

    def __init__(self, params: Params, catalogs: CatalogSet,
                 count_tokens: Callable[[list[str]], list[int]] | None = None):
        self.p = params
        self.cs = catalogs
        self.seed = params.run.seed
        self.resolver = Resolver(params.resolution)
        self.budget = budget_mode(params)
        if self.budget == "exact" and count_tokens is None:
            raise PlanError("token_budget 'exact' needs a tokenizer (caption.tokenizer)")
        self.count_tokens = count_tokens
        live = np.flatnonzero(catalogs.live)
        th = np.zeros(len(catalogs), np.int64)
        tw = np.zeros(len(catalogs), np.int64)
        if len(live):
            th[live], tw[live] = self.resolver.targets(catalogs.w[live], catalogs.h[live])
        self.th, self.tw = th, tw
        self.img_tokens = (th // 16) * (tw // 16)
        self.templates = [d.caption or params.caption.template for d in catalogs.datasets]
        est = np.zeros(len(catalogs), np.int64)
        for d, tpl in enumerate(self.templates):
            sl = slice(int(catalogs.offsets[d]), int(catalogs.offsets[d + 1]))
            chars = tpl.estimate_chars({k: v[sl] for k, v in catalogs.chars.items()})
            est[sl] = self._estimate(chars)
        self.text_estimate = est
        self._captions: dict[tuple[int, int], str] = {}
        self.held = validation_rows(params, catalogs)  # never trained on

    @property
    def train_weight(self) -> np.ndarray:
        """Each row's sampling weight, the held-out rows' zero."""
        return np.where(self.held, np.float32(0), self.cs.weight).astype(np.float32)

    def _estimate(self, chars: Any) -> Any:
        c = self.p.caption
        return estimate_text_tokens(chars, c.chars_per_token, c.overhead_tokens, c.max_text_tokens)

    def caption(self, row: int, variant: int) -> str:
        key = (row, variant)
        if key not in self._captions:
            d = int(self.cs.dataset[row])
            self._captions[key] = render_caption(self.templates[d], self.cs.row(row), self.seed,
                                                 int(self.cs.uid[row]), variant)
        return self._captions[key]

    def epoch_order(self, epoch: int) -> np.ndarray:
        rng = rng_of("epoch-order", self.seed, epoch)
        w = self.train_weight
        whole = np.floor(w).astype(np.int64)
        frac = (w - whole.astype(np.float32)).astype(np.float32)
        extra = rng.random(len(w), dtype=np.float32) < frac
        return rng.permutation(np.repeat(np.arange(len(w)), whole + extra))

    def occurrence(self, epoch: int, position: int, row: int) -> Occurrence:
        res = self.p.resolution
        uid = int(self.cs.uid[row])
        rng = rng_of("item", self.seed, epoch, position, uid)
        w, h = int(self.cs.w[row]), int(self.cs.h[row])
        th, tw = int(self.th[row]), int(self.tw[row])
        box = self.resolver.crop_box(w, h, th, tw, rng if self.resolver.random_crop else None)
        flip = bool(rng.random() < 0.5) if res.flip else False
        variant = int(rng.integers(self.p.caption.variants))
        return Occurrence(epoch, position, row, (th, tw), tuple(int(v) for v in box), flip, variant)

    def _text_tokens(self, occ: list[Occurrence]) -> None:
        if self.budget == "estimate":
            for o in occ:
                o.text_tokens = int(self.text_estimate[o.row])
            return
        for o in occ:
            o.caption = self.caption(o.row, o.variant)
        if self.budget == "render":
            lens = self._estimate(np.array([len(o.caption) for o in occ], np.int64))
        else:
            lens = self.count_tokens([o.caption for o in occ])
        for o, n in zip(occ, lens):
            o.text_tokens = int(n)

    def plan_epoch(self, epoch: int) -> EpochResult:
        order = self.epoch_order(epoch)
        occ = [self.occurrence(epoch, pos, int(r)) for pos, r in enumerate(order)]
        self._text_tokens(occ)
        kept, dropped, fitted = self._fitted(occ, epoch)
        batches, unbatched = self._batched(kept)
        if self.p.resolution.mode == "bucket" or self.p.batching.mode == "tokens_ffd":
            perm = rng_of("batch-order", self.seed, epoch).permutation(len(batches))
            batches = [batches[i] for i in perm]
        return EpochResult(batches, len(occ), dropped, fitted, unbatched)

    def plan_validation(self) -> list[list[Occurrence]]:
        """The held-out images' batches (``held``): the first ``validation.max_samples`` by
        identity, each once, centre-cropped, unflipped, its first caption variant, packed
        as the training batches are (``docs/training.md#validation``)."""
        rows = np.flatnonzero(self.held)
        rows = rows[np.argsort(self.cs.uid[rows], kind="stable")][: self.p.validation.max_samples]
        occ = []
        for pos, r in enumerate(rows.tolist()):
            w, h, th, tw = int(self.cs.w[r]), int(self.cs.h[r]), int(self.th[r]), int(self.tw[r])
            box = self.resolver.crop_box(w, h, th, tw, None)
            occ.append(Occurrence(0, pos, r, (th, tw), tuple(int(v) for v in box), False, 0))
        self._text_tokens(occ)
        kept, _, _ = self._fitted(occ, 0)
        batches, _ = self._batched(kept)
        for batch in batches:
            for o in batch:
                if o.caption is None:
                    o.caption = self.caption(o.row, o.variant)
        return batches

    def _fitted(self, occ: list[Occurrence], epoch: int) -> tuple[list[Occurrence], int, int]:
        """The occurrences that fit ``batching.max_tokens`` (fitted as ``overlong`` says)."""
        b = self.p.batching
        kept, dropped, fitted = [], 0, 0
        for o in occ:
            img = int(self.img_tokens[o.row])
            fit = fit_overlong(img, o.text_tokens, b.max_tokens, b.overlong)
            if fit is None:
                dropped += 1
                continue
            if fit.text_limit is not None or fit.img_keep is not None:
                fitted += 1
            o.image_tokens, o.text_tokens = fit.img_tokens, fit.text_tokens
            if fit.text_limit is not None:
                o.text_limit = fit.text_limit
            if fit.img_keep is not None:
                o.img_keep = fit.img_keep
                o.keep_seed = keep_seed(self.seed, epoch, o.position, int(self.cs.uid[o.row]))
            kept.append(o)
        return kept, dropped, fitted

    def _batched(self, kept: list[Occurrence]) -> tuple[list[list[Occurrence]], int]:
        b = self.p.batching
        if self.p.resolution.mode == "bucket":
            streams: dict[tuple[int, int], list[Occurrence]] = {}
            for o in kept:
                streams.setdefault(o.target, []).append(o)
            stream_list = [streams[k] for k in sorted(streams)]
        else:
            stream_list = [kept]
        batches: list[list[Occurrence]] = []
        unbatched = 0
        for stream in stream_list:
            tokens = [o.image_tokens + o.text_tokens for o in stream]
            if b.mode == "tokens":
                groups = pack_greedy(tokens, b.max_tokens, b.max_samples)
            elif b.mode == "tokens_ffd":
                groups = pack_ffd(tokens, b.max_tokens, b.max_samples, b.window)
            else:
                groups, left = pack_count(len(stream), b.batch_size, b.drop_last)
                unbatched += left
            batches += [[stream[i] for i in g] for g in groups]
        return batches, unbatched

    def plan_batches(self, total: int, progress: bool = True) -> tuple[list[list[Occurrence]], list[EpochResult]]:
        if not self.cs.live.any():
            raise PlanError("the catalogs hold no live image; check the datasets and run `kmoss scan`")
        if not (self.cs.live & ~self.held).any():
            raise PlanError("every live image is held out for validation (validation.share, or "
                            "datasets with validation: true): lower validation.share or train "
                            "on another dataset entry")
        batches: list[list[Occurrence]] = []
        epochs: list[EpochResult] = []
        with progress_bar(total, "plan", "batch", leave=False, enabled=progress) as bar:
            while len(batches) < total:
                ep = self.plan_epoch(len(epochs))
                if not ep.batches:
                    raise PlanError(
                        f"epoch {len(epochs)} yields no batch: {ep.items} samples, {ep.dropped} "
                        f"dropped as over-long (batching.max_tokens = {self.p.batching.max_tokens}, "
                        f"overlong = {self.p.batching.overlong!r}), {ep.unbatched} left unbatched; "
                        f"raise batching.max_tokens or lower resolution.target_area"
                        + ("" if self.p.batching.overlong != "drop" else
                           ", or set batching.overlong to 'drop_tokens' or 'truncate_text'"))
                epochs.append(ep)
                take = ep.batches[: total - len(batches)]
                batches += take
                bar.update(len(take))
        for batch in batches:
            for o in batch:
                if o.caption is None:
                    o.caption = self.caption(o.row, o.variant)
        return batches, epochs


def validation_rows(p: Params, cs: CatalogSet) -> np.ndarray:
    """Which catalog rows are held out for validation: every live row of a dataset entry
    with ``validation: true``, and ``validation.share`` of the others, by a hash of each
    row's identity (the same rows stay out as a catalog grows)."""
    held = np.array([cs.datasets[int(d)].validation for d in cs.dataset], bool) if len(cs) \
        else np.zeros(0, bool)
    share = p.validation.share
    if share > 0:
        draws = np.array([seed_of("validation", int(u)) for u in cs.uid], np.float64) / 2.0**64
        held |= draws < share
    return held & cs.live


def total_batches(p: Params) -> int:
    return p.train.steps * p.train.grad_accum * p.parallel.world_size
