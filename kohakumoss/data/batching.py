"""Token batching: over-long fit and the three packers (``docs/data.md#batching``).

All packers take the epoch's (or one bucket's) ordered item stream and return batches as
lists of positions into that stream; they never reorder batches (the planner shuffles
them with ``("batch-order", seed, epoch)`` where ``docs/data.md#streams-and-batch-order``
says so).

- ``pack_greedy`` (``batching.mode: tokens``): walk the stream, close the batch when the
  next item would overflow ``max_tokens`` or the batch holds ``max_samples`` items. The
  final partial batch is kept.
- ``pack_ffd`` (``tokens_ffd``): first-fit-decreasing inside windows of ``window`` items;
  bins are per window and become batches in creation order.
- ``pack_count`` (``count``): groups of ``batch_size``; the tail is dropped when
  ``drop_last`` and its size is returned as the unbatched count.

``max_samples`` 0 means no cap. An item larger than ``max_tokens`` (only possible when the
over-long fit was skipped) always gets a batch of its own.
"""

from __future__ import annotations

import dataclasses
import itertools
from bisect import bisect_right
from collections.abc import Sequence

import numpy as np

from kohakumoss.seeding import rng_of, seed_of

OVERLONG_POLICIES = ("drop", "truncate_text", "drop_tokens")


@dataclasses.dataclass(frozen=True)
class Fit:
    """A sample that fits the budget: its planned tokens after the over-long policy.

    ``text_limit`` is set when the text was truncated (keep the first ``text_limit``
    tokens); ``img_keep`` when image tokens were dropped (``img_tokens == img_keep``).
    """

    img_tokens: int
    text_tokens: int
    text_limit: int | None = None
    img_keep: int | None = None

    @property
    def tokens(self) -> int:
        return self.img_tokens + self.text_tokens


def fit_overlong(img_tokens: int, text_tokens: int, limit: int, policy: str) -> Fit | None:
    """Apply the ``overlong`` policy to one sample (``docs/data.md#over-long-samples``);
    ``None`` means dropped.

    Fitting never cuts below one text and one image token: when that would be needed
    the sample is dropped instead. (A sample arriving with 0 text tokens, e.g. an empty
    caption with ``caption.overhead_tokens: 0``, is passed through as it is.)
    """
    if policy not in OVERLONG_POLICIES:
        raise ValueError(f"batching.overlong: {policy!r} is not one of "
                         f"{', '.join(OVERLONG_POLICIES)}")
    if img_tokens < 1 or text_tokens < 0:
        raise ValueError(f"fit_overlong: need img_tokens >= 1 and text_tokens >= 0, "
                         f"got {img_tokens} and {text_tokens}")
    if img_tokens + text_tokens <= limit:
        return Fit(img_tokens, text_tokens)
    if policy == "truncate_text":
        keep = limit - img_tokens
        return Fit(img_tokens, keep, text_limit=keep) if keep >= 1 else None
    if policy == "drop_tokens":
        keep = limit - text_tokens
        return Fit(keep, text_tokens, img_keep=keep) if keep >= 1 else None
    return None


def keep_seed(seed: int, epoch: int, position: int, row_id: int) -> int:
    """``seed_of("img-keep", seed, epoch, position, row_id)`` of one occurrence
    (``docs/data.md#seeding``).

    Arguments are cast to ``int`` first: the seed hashes their ``repr``, and a numpy
    integer's repr differs from a Python int's.
    """
    return seed_of("img-keep", int(seed), int(epoch), int(position), int(row_id))


def kept_token_indices(n_image_tokens: int, img_keep: int, keep_seed: int) -> np.ndarray:
    """Sorted int64 indices of the image tokens that survive ``drop_tokens``
    (``docs/data.md#over-long-samples``)."""
    n, k = int(n_image_tokens), int(img_keep)
    if not 1 <= k <= n:
        raise ValueError(f"kept_token_indices: need 1 <= img_keep <= n_image_tokens, "
                         f"got img_keep={k}, n_image_tokens={n}")
    picked = rng_of("img-keep", int(keep_seed)).choice(n, k, replace=False)
    return np.sort(picked).astype(np.int64)


def _check(tokens: Sequence[int] | np.ndarray, max_tokens: int, max_samples: int) -> list[int]:
    if max_tokens < 1:
        raise ValueError(f"batching.max_tokens must be >= 1, got {max_tokens}")
    if max_samples < 0:
        raise ValueError(f"batching.max_samples must be >= 0 (0 = no cap), got {max_samples}")
    arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if arr.size and arr.min() < 0:
        raise ValueError(f"token counts must be >= 0, got {int(arr.min())} at position "
                         f"{int(arr.argmin())}")
    return arr.tolist()


def pack_greedy(tokens: Sequence[int] | np.ndarray, max_tokens: int,
                max_samples: int) -> list[list[int]]:
    """Greedy in-order token batches (``tokens``, ``docs/data.md#packers``); the last
    partial batch is kept."""
    t = _check(tokens, max_tokens, max_samples)
    n = len(t)
    # With non-negative counts the greedy batch from s is the longest prefix whose sum
    # fits (at least one item), so one bisection over prefix sums finds its end.
    prefix = list(itertools.accumulate(t, initial=0))
    cap = max_samples or n
    batches = []
    s = 0
    while s < n:
        e = bisect_right(prefix, prefix[s] + max_tokens, s + 1, n + 1) - 1
        e = min(max(e, s + 1), s + cap)
        batches.append(list(range(s, e)))
        s = e
    return batches


def pack_ffd(tokens: Sequence[int] | np.ndarray, max_tokens: int, max_samples: int,
             window: int) -> list[list[int]]:
    """First-fit-decreasing inside windows of ``window`` items (``tokens_ffd``,
    ``docs/data.md#packers``).

    Within a window items go in (tokens descending, position ascending) order into the
    first bin with room and fewer than ``max_samples`` items, else into a new bin.
    Batches list positions in placement order.
    """
    t = _check(tokens, max_tokens, max_samples)
    if window < 1:
        raise ValueError(f"batching.window must be >= 1, got {window}")
    n = len(t)
    cap = max_samples or n + 1
    batches: list[list[int]] = []
    room = np.empty(window, dtype=np.int64)
    count = np.empty(window, dtype=np.int64)
    for start in range(0, n, window):
        order = sorted(range(start, min(start + window, n)), key=lambda i: (-t[i], i))
        bins: list[list[int]] = []
        for i in order:
            ti = t[i]
            nb = len(bins)
            b = nb
            if nb:
                ok = (room[:nb] >= ti) & (count[:nb] < cap)
                first = int(ok.argmax())
                if ok[first]:
                    b = first
            if b == nb:
                bins.append([i])
                room[b] = max_tokens - ti
                count[b] = 1
            else:
                bins[b].append(i)
                room[b] -= ti
                count[b] += 1
        batches.extend(bins)
    return batches


def pack_count(n: int, batch_size: int, drop_last: bool) -> tuple[list[list[int]], int]:
    """Consecutive groups of ``batch_size`` (``count``, ``docs/data.md#packers``) and the
    unbatched count."""
    if batch_size < 1:
        raise ValueError(f"batching.batch_size must be >= 1, got {batch_size}")
    if n < 0:
        raise ValueError(f"pack_count: n must be >= 0, got {n}")
    full = n // batch_size
    batches = [list(range(i * batch_size, (i + 1) * batch_size)) for i in range(full)]
    tail = n - full * batch_size
    if tail and not drop_last:
        batches.append(list(range(full * batch_size, n)))
        tail = 0
    return batches, tail
