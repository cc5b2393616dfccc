"""What the cache stages encode: exactly the captions and crops the plan will use.

``text_items`` / ``latent_items`` turn a plan into ``{key: item}`` (deduplicated); the
``fill_*`` functions encode the items a store lacks and write them shard by shard, so a
killed fill resumes from its last complete shard. A fill holds the store's lock throughout
(a second fill of the same directory waits, then finds the entries cached).

Encoders are batched, and batching changes the last bits of a result (padding width, the
kernels picked for a batch size), so the batches are fixed by the whole item set, never by
what happens to be missing: the items are cut into fixed groups (text: ``batch`` captions
in (length, text) order; latents: ``batch_groups`` of same-size crops in (size, key)
order) and a group with any missing entry is encoded whole, storing only the missing ones.
A resumed, repaired or re-run fill therefore stores the very bytes an uninterrupted one
does (given an encoder that is deterministic for a given batch: CPU, or deterministic CUDA
kernels; ``draw: sample`` is random by design). Encoders are built lazily by the caller's
factory: a fill with nothing missing never loads a 9B text encoder.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import torch

from kohakumoss import faults
from kohakumoss.cache.keys import background_name, content_identity, latent_key, mask_key, text_key
from kohakumoss.cache.store import TensorStore
from kohakumoss.config import Params
from kohakumoss.data.catalogset import CatalogSet
from kohakumoss.data.loader import decode_image, to_model_range
from kohakumoss.data.masks import mask_path, mask_source, mask_tokens
from kohakumoss.encoders.vae import batch_groups, to_tokens
from kohakumoss.progress import progress

log = logging.getLogger(__name__)


@dataclasses.dataclass
class FillStats:
    wanted: int = 0
    cached: int = 0
    encoded: int = 0
    dropped_shards: list[str] = dataclasses.field(default_factory=list)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)


def text_items(plan: pa.Table, encoder_key_id: str, storage: str) -> dict[str, str]:
    """``{key: caption}`` for every caption training reads (dropped slots read "")."""
    captions = plan.column("caption").to_pylist()
    drop = plan.column("text_drop").to_pylist()
    used = sorted({c for c, d in zip(captions, drop) if not d} | {""})
    return {text_key(encoder_key_id, storage, c): c for c in used}


def _start(store: TensorStore, items: dict) -> tuple[FillStats, set[str]]:
    """Drop damaged shards, then what of ``items`` is still missing (lock held)."""
    stats = FillStats(wanted=len(items), dropped_shards=store.verify())
    missing = set(store.missing(items))
    stats.cached = stats.wanted - len(missing)
    if missing:
        faults.point("cache.fill")
    return stats, missing


def fill_text(store: TensorStore, items: dict[str, str], encoder: Callable[[], object],
              batch: int, max_tokens: int, chunk: int | None = None) -> FillStats:
    """Encode the missing captions in fixed chunks of ``chunk`` (default ``batch``) captions
    of the whole set, ordered by (length, text): each chunk is about one encoder call."""
    with store.writing():
        stats, missing = _start(store, items)
        if not missing:
            return stats
        order = sorted(items, key=lambda k: (len(items[k]), items[k]))
        step = chunk or batch
        todo = [c for c in (order[i:i + step] for i in range(0, len(order), step)) if missing.intersection(c)]
        enc = encoder()
        with progress(len(missing), "cache_text", "caption") as bar:
            for keys in todo:
                embs = enc.encode([items[k] for k in keys], batch=batch, max_tokens=max_tokens)
                new = [(k, e) for k, e in zip(keys, embs) if k in missing]
                for key, emb in new:
                    store.add(key, emb)
                bar.update(len(new))
                stats.encoded += len(new)
        store.flush()
    return stats


@dataclasses.dataclass(frozen=True)
class LatentItem:
    dataset: int
    locator: str
    box: tuple[int, int, int, int]
    target: tuple[int, int]  # (h, w) pixels
    flip: bool


@dataclasses.dataclass(frozen=True)
class MaskItem:
    """A sample's loss mask at token resolution (``data.masks``), stored beside its latents."""

    dataset: int
    locator: str
    box: tuple[int, int, int, int]
    target: tuple[int, int]
    flip: bool
    kind: str  # file | alpha
    latent: str  # the latent entry's key (a mask that fails marks its sample failed)


def latent_items(plan: pa.Table, cs: CatalogSet, p: Params, encoder_key_id: str
                 ) -> dict[str, LatentItem | MaskItem]:
    res, storage, draw = p.resolution, p.cache.dtype, p.encoders.draw
    bg = background_name(res.background)
    cols = {c: plan.column(c).to_numpy(zero_copy_only=False) for c in
            ("dataset", "row", "target_h", "target_w", "crop_l", "crop_t", "crop_r", "crop_b", "flip")}
    seen: set[tuple] = set()
    items: dict[str, LatentItem] = {}
    for i in range(plan.num_rows):
        sig = tuple(int(cols[c][i]) for c in cols)
        if sig in seen:
            continue
        seen.add(sig)
        d, row, th, tw, l, t, r, b, flip = sig
        pos = int(cs.offsets[d]) + row
        rec = cs.row(pos)
        content = content_identity(rec.extra.get("hash"), rec.locator, rec.w, rec.h)
        key = latent_key(content, encoder_key_id, storage, (th, tw), (l, t, r, b), bool(flip), bg,
                         rec.has_alpha, res.resample, draw)
        items[key] = LatentItem(d, rec.locator, (l, t, r, b), (th, tw), bool(flip))
        source = mask_source(p.data.datasets[d].mask, rec.extra, rec.has_alpha)
        if source is not None:
            items[mask_key(key, *source)] = MaskItem(d, rec.locator, (l, t, r, b), (th, tw),
                                                     bool(flip), source[0], key)
    return items


def fill_latents(store: TensorStore, items: dict[str, LatentItem], p: Params,
                 encoder: Callable[[], object], generator: torch.Generator | None = None) -> FillStats:
    """Decode (threads) and encode the groups of same-size crops that miss an entry, then
    make the missing loss masks."""
    with store.writing():
        stats, missing = _start(store, items)
        if not missing:
            return stats
        latents = {k: v for k, v in items.items() if isinstance(v, LatentItem)}
        if missing.intersection(latents):
            _encode_groups(store, latents, missing.intersection(latents), p, encoder, generator, stats)
        _fill_masks(store, items, sorted(k for k in missing if isinstance(items[k], MaskItem)), p, stats)
        store.flush()
    return stats


def _fill_masks(store: TensorStore, items: dict, keys: list[str], p: Params, stats: FillStats) -> None:
    """Each missing mask from its file or the image's alpha channel; a mask that cannot be
    made (no file, another size than its image) is reported and its sample left out."""
    if not keys:
        return
    with progress(len(keys), "cache_latents masks", "mask") as bar:
        for key in keys:
            _fill_mask(store, items, key, p, stats)
            bar.update(1)


def _fill_mask(store: TensorStore, items: dict, key: str, p: Params, stats: FillStats) -> None:
    it = items[key]
    source = p.data.datasets[it.dataset].args
    try:
        mask = source.open(mask_path(it.locator)) if it.kind == "file" else None
        tokens = mask_tokens(it.kind, source.open(it.locator), mask, it.box, it.target, it.flip,
                             p.data.max_image_pixels, f"dataset {it.dataset} {it.locator}")
    except Exception as err:  # reported and skipped, never fatal
        stats.failed[key] = stats.failed[it.latent] = (
            f"dataset {it.dataset} {it.locator}: {type(err).__name__}: {err}")
        log.warning("cache_latents: skipping %s", stats.failed[key])
        return
    store.add(key, tokens)
    stats.encoded += 1


def _encode_groups(store: TensorStore, items: dict[str, LatentItem], missing: set[str], p: Params,
                   encoder: Callable[[], object], generator: torch.Generator | None,
                   stats: FillStats) -> None:
    res, e = p.resolution, p.encoders
    order = sorted(items, key=lambda k: (items[k].target, k))  # same sizes adjacent
    groups = [[order[i] for i in g] for g in
              batch_groups([items[k].target for k in order], e.vae_batch_pixels, e.vae_batch)]
    groups = [g for g in groups if missing.intersection(g)]

    def decode(key: str) -> torch.Tensor:
        it = items[key]
        data = p.data.datasets[it.dataset].args.open(it.locator)
        return to_model_range(decode_image(data, it.box, it.target, it.flip, res.background,
                                           res.resample, p.data.max_image_pixels))

    def stack(group: list[str]) -> tuple[list[str], torch.Tensor | None]:
        ok, pixels = [], []
        for key in group:
            try:
                pixels.append(decode(key))
                ok.append(key)
            except Exception as err:  # a broken image is reported and skipped, never fatal
                if key in missing:  # (a cached entry stays usable)
                    it = items[key]
                    stats.failed[key] = f"dataset {it.dataset} {it.locator}: {type(err).__name__}: {err}"
                    log.warning("cache_latents: skipping %s", stats.failed[key])
        return ok, (torch.stack(pixels) if pixels else None)

    vae = encoder()
    ahead = 2 * e.decode_workers  # groups decoded ahead of the encoder, bounded
    with ThreadPoolExecutor(e.decode_workers) as pool, \
            progress(len(missing), "cache_latents", "image") as bar:
        futures = [pool.submit(stack, g) for g in groups[:ahead]]
        for i, group in enumerate(groups):
            keys, pixels = futures[i].result()
            futures[i] = None
            if i + ahead < len(groups):
                futures.append(pool.submit(stack, groups[i + ahead]))
            if pixels is not None:
                latents = vae.encode(pixels, draw=e.draw, generator=generator)
                new = [(k, t) for k, t in zip(keys, to_tokens(latents)) if k in missing]
                for key, tokens in new:
                    store.add(key, tokens)
                stats.encoded += len(new)
            bar.update(len(missing.intersection(group)))


def record_build(directory: Path, settings: dict) -> None:
    """Append the key-shaping settings of a fill to ``builds.json`` (for miss messages)."""
    path = directory / "builds.json"
    try:
        builds = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []
    except ValueError:  # informative only (not part of the manifest): start it again
        builds = []
    builds = builds if isinstance(builds, list) else []
    if settings not in builds:
        from kohakumoss.artifacts import atomic_write_json

        atomic_write_json(path, builds + [settings])
