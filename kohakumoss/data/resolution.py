"""Resolution planning: each image's target size and crop box (``docs/data.md#resolution``).

Sizes are ``(h, w)`` in pixels; function arguments keep the reference's ``(w, h)`` order for
source sizes. Every target side is a multiple of ``size_step`` (itself a multiple of 16,
one latent token per 16x16 pixels) and at least ``size_step``, and every target's w/h lies
inside ``aspect_range`` (the final aspect pass of ``fit`` step 5 guarantees it). A crop box
is ``(left, top, right, bottom)`` in source pixels; decode crops it, then resamples only
when its size differs from the target.

Modes (``ResolutionConfig.mode``):

- ``resize``: ``fit(w, h)`` (``docs/data.md#aspect-clamp-and-fit``): the aspect-clamped
  native size scaled to at most ``target_area`` (never upscaled unless ``upscale:
  to_area``), sides rounded down to the step. Crop box = the largest sub-rectangle with the
  target's aspect (``docs/data.md#crop-box``), resized.
- ``bucket`` (``docs/data.md#buckets``): the bucket nearest in log-aspect to the *raw*
  source aspect (first in sorted order wins ties); with ``upscale: never`` a source whose
  pixel area is below its bucket's area gets its own ``fit(w, h)`` target instead. Crop
  box as for ``resize``.
- ``square`` (``docs/data.md#square-crop-and-keep``), the reference's ``square_crop``: every
  target is ``side x side`` with ``side = max(step, floor(sqrt(area) / step) * step)``,
  always resized (``upscale`` is ignored). With ``crop: random`` it is the reference's
  ``shifted_square``.
- ``crop``: a native-scale window, no resampling. The target is ``fit(w, h)`` with
  ``upscale`` forced to never, so it never exceeds the source, and the crop box is
  exactly the target's size.
- ``keep``: native size. Target = the aspect-clamped size with each side rounded down to
  the step (at least one step), then the aspect pass of ``fit`` step 5; no area limit
  (over-long samples are the batching's ``overlong`` policy's business). The crop box is
  exactly the target's size.

``crop`` and ``keep`` on a source with a side shorter than ``size_step``: the target side
is still ``size_step``, which the source cannot hold, so the box falls back to the
``resize`` box (largest sub-rectangle with the target's aspect) and that crop is upscaled.
This is the only case where these two modes resample.

Crop position: ``rng=None`` centres the box (``left = (w - cw) // 2``, ``top = (h - ch) //
2``); a generator draws ``left`` then ``top``, each ``rng.integers(0, slack + 1)``, as the
per-occurrence draw order (``docs/data.md#per-occurrence-draws``) requires.
``Resolver.random_crop`` says which one the plan should use (``crop: random``).
"""

from __future__ import annotations

import math
from bisect import bisect_left

import numpy as np

from kohakumoss.config import ResolutionConfig

LATENT_FACTOR = 16  # pixels per latent token per side (VAE /8, then 2x2 patchify)

Aspect = tuple[float, float]


def image_tokens(th, tw):
    """Latent tokens of a ``th x tw`` target: ``(th // 16) * (tw // 16)`` (ints or arrays)."""
    return (th // LATENT_FACTOR) * (tw // LATENT_FACTOR)


def aspect_clamp(w: int, h: int, aspect: Aspect) -> tuple[int, int]:
    """Largest centred sub-size ``(cw, ch)`` of ``w x h`` with w/h inside ``aspect``
    (``docs/data.md#aspect-clamp-and-fit``)."""
    lo, hi = aspect
    if w / h > hi:
        return max(1, round(h * hi)), h
    if w / h < lo:
        return w, max(1, round(w / lo))
    return w, h


def _aspect_pass(th: int, tw: int, step: int, aspect: Aspect) -> tuple[int, int]:
    """``fit`` step 5: shave a step off the long side until w/h is inside ``aspect``."""
    lo, hi = aspect
    while tw / th > hi and tw > step:
        tw -= step
    while tw / th < lo and th > step:
        th -= step
    return th, tw


def fit(w: int, h: int, *, area: int, step: int, aspect: Aspect, upscale: bool) -> tuple[int, int]:
    """Native-aspect target ``(th, tw)`` of a ``w x h`` source
    (``docs/data.md#aspect-clamp-and-fit``)."""
    cw, ch = aspect_clamp(w, h, aspect)
    scale = math.sqrt(area / (cw * ch))
    if not upscale:
        scale = min(scale, 1.0)
    tw = max(step, int(cw * scale) // step * step)
    th = max(step, int(ch * scale) // step * step)
    native = math.log(cw / ch)
    best, best_d = (th, tw), math.inf
    for c_th, c_tw in ((th, tw), (th - step, tw), (th, tw - step)):
        if c_th < step or c_tw < step:
            continue
        d = abs(math.log(c_tw / c_th) - native)
        if d < best_d:
            best, best_d = (c_th, c_tw), d
    return _aspect_pass(best[0], best[1], step, aspect)


def bucket_list(area: int, step: int, aspect: Aspect) -> list[tuple[int, int]]:
    """The ``(h, w)`` buckets (``docs/data.md#buckets``), deduplicated and sorted by w/h
    ascending."""
    lo, hi = aspect
    out = set()
    w = step
    while w <= math.sqrt(area * hi) + step:
        h = (area // w) // step * step
        if h >= step and lo <= w / h <= hi:
            out.add((h, w))
        w += step
    return sorted(out, key=lambda hw: hw[1] / hw[0])


def square_side(area: int, step: int) -> int:
    """Side of every ``square`` target: ``max(step, floor(sqrt(area) / step) * step)``."""
    return max(step, int(math.sqrt(area) / step) * step)


def crop_size(w: int, h: int, th: int, tw: int) -> tuple[int, int]:
    """``(cw, ch)`` of the largest sub-rectangle of ``w x h`` with the target's aspect
    (``docs/data.md#crop-box``)."""
    if w / h > tw / th:
        return max(1, min(w, round(h * tw / th))), h
    return w, max(1, min(h, round(w * th / tw)))


class Resolver:
    """Targets and crop boxes for one ``ResolutionConfig``; targets are memoised per size."""

    def __init__(self, cfg: ResolutionConfig):
        self.cfg = cfg
        self.mode = cfg.mode
        self.step = cfg.size_step
        self.area = cfg.target_area
        self.aspect: Aspect = (float(cfg.aspect_range[0]), float(cfg.aspect_range[1]))
        self.upscale = cfg.upscale == "to_area"
        self.random_crop = cfg.crop == "random"
        self.buckets: list[tuple[int, int]] = []
        self._bucket_logs: list[float] = []
        self._memo: dict[tuple[int, int], tuple[int, int]] = {}
        if self.mode == "bucket":
            self.buckets = bucket_list(self.area, self.step, self.aspect)
            if not self.buckets:
                raise ValueError(
                    f"resolution: no bucket of area <= target_area={self.area} with sides a "
                    f"multiple of size_step={self.step} has w/h in aspect_range={self.aspect}; "
                    f"raise target_area, lower size_step or widen aspect_range")
            self._bucket_logs = [math.log(bw / bh) for bh, bw in self.buckets]
        elif self.mode not in ("resize", "square", "crop", "keep"):
            raise ValueError(f"resolution.mode: {self.mode!r} is not one of "
                             f"resize, bucket, square, crop, keep")

    # -- targets ---------------------------------------------------------------------

    def target(self, w: int, h: int) -> tuple[int, int]:
        """Target ``(th, tw)`` of a ``w x h`` source."""
        key = (w, h)
        hit = self._memo.get(key)
        if hit is None:
            if w < 1 or h < 1:
                raise ValueError(f"image size {w}x{h} has no pixels; rejected rows (size 0) "
                                 f"must be filtered out before planning")
            hit = self._memo[key] = self._compute(int(w), int(h))
        return hit

    def targets(self, w: np.ndarray, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised ``target``: int64 arrays ``(th, tw)``, one scalar call per distinct size."""
        w = np.asarray(w, dtype=np.int64)
        h = np.asarray(h, dtype=np.int64)
        if w.shape != h.shape:
            raise ValueError(f"targets: w and h shapes differ ({w.shape} vs {h.shape})")
        if w.size == 0:
            return np.zeros(w.shape, np.int64), np.zeros(w.shape, np.int64)
        if w.min() < 1 or h.min() < 1 or max(w.max(), h.max()) >= 1 << 31:
            bad = int(np.flatnonzero((w < 1) | (h < 1) | (w >= 1 << 31) | (h >= 1 << 31))[0])
            raise ValueError(f"image size {int(w.flat[bad])}x{int(h.flat[bad])} at index {bad} "
                             f"is out of range 1..2**31-1; filter rejected rows before planning")
        uniq, inverse = np.unique((w << 32) | h, return_inverse=True)
        table = np.array([self.target(k >> 32, k & 0xFFFFFFFF) for k in uniq.tolist()],
                         dtype=np.int64).reshape(-1, 2)
        inverse = inverse.reshape(w.shape)
        return table[inverse, 0], table[inverse, 1]

    def _compute(self, w: int, h: int) -> tuple[int, int]:
        step, aspect = self.step, self.aspect
        if self.mode == "resize":
            return fit(w, h, area=self.area, step=step, aspect=aspect, upscale=self.upscale)
        if self.mode == "bucket":
            return self._bucket(w, h)
        if self.mode == "square":
            side = square_side(self.area, step)
            return side, side
        if self.mode == "crop":
            return fit(w, h, area=self.area, step=step, aspect=aspect, upscale=False)
        cw, ch = aspect_clamp(w, h, aspect)  # keep
        return _aspect_pass(max(step, ch // step * step), max(step, cw // step * step),
                            step, aspect)

    def _bucket(self, w: int, h: int) -> tuple[int, int]:
        logs = self._bucket_logs
        x = math.log(w / h)
        # Distances |log_i - x| fall then rise along the sorted list, so the minimum sits
        # at the crossing; walking left over equal distances keeps "first wins".
        i = bisect_left(logs, x)
        if i == len(logs) or (i > 0 and abs(logs[i - 1] - x) <= abs(logs[i] - x)):
            i -= 1
        while i > 0 and abs(logs[i - 1] - x) == abs(logs[i] - x):
            i -= 1
        bh, bw = self.buckets[i]
        if not self.upscale and w * h < bh * bw:
            return fit(w, h, area=self.area, step=self.step, aspect=self.aspect, upscale=False)
        return bh, bw

    # -- crops -----------------------------------------------------------------------

    def crop_box(self, w: int, h: int, th: int, tw: int,
                 rng: np.random.Generator | None) -> tuple[int, int, int, int]:
        """``(left, top, right, bottom)`` of the source region that becomes the target.

        ``rng=None`` centres it; otherwise left then top are drawn from ``rng``.
        """
        if self.mode in ("crop", "keep") and tw <= w and th <= h:
            cw, ch = tw, th
        else:
            cw, ch = crop_size(w, h, th, tw)
        if rng is None:
            left, top = (w - cw) // 2, (h - ch) // 2
        else:
            left = int(rng.integers(0, w - cw + 1))
            top = int(rng.integers(0, h - ch + 1))
        return left, top, left + cw, top + ch

    def resizes(self, w: int, h: int, box: tuple[int, int, int, int], th: int, tw: int) -> bool:
        """Whether decode must resample the cropped ``box`` of a ``w x h`` source."""
        left, top, right, bottom = box
        assert 0 <= left < right <= w and 0 <= top < bottom <= h, (box, w, h)
        return (right - left, bottom - top) != (tw, th)
