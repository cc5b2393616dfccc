"""How training reads the caches, per mode (``cache.text`` / ``cache.latents``).

- ``offline``: every entry must be there; a miss raises ``CacheMiss`` naming the entry and
  the stage that builds it.
- ``online``: all-or-nothing per batch: if every sample hits, the cached tensors are used;
  if any misses, ``None`` is returned, the trainer encodes the whole batch and hands the
  fresh tensors to ``write_back``, which stores them and returns them rounded exactly as a
  later hit would read them.
- ``off``: always ``None``; nothing is read or written.

Reads need no lock: the index is replaced atomically, and every entry read is checked
against its digest (``TensorStore.get``), so a corrupt shard or index is an
``IntegrityError`` naming the file and ``kmoss cache_text`` / ``kmoss cache_latents``.
``online`` write-backs take the cache directory's lock for each shard they write (waiting
while a cache stage fills the same directory).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from kohakumoss.cache.keys import background_name, content_identity, latent_key, mask_key, text_key
from kohakumoss.cache.store import TensorStore, storage_round_trip
from kohakumoss.config import Params
from kohakumoss.data.catalogset import CatalogSet
from kohakumoss.data.loader import HostBatch
from kohakumoss.data.masks import mask_path, mask_source, mask_tokens
from kohakumoss.errors import IntegrityError


@dataclasses.dataclass
class CacheView:
    store: TensorStore | None
    mode: str
    rebuild: str

    def read(self, keys: list[str], describe) -> list[torch.Tensor] | None:
        if self.mode == "off" or self.store is None:
            return None
        if self.mode == "offline":
            return self.store.get_many(keys, describe, self.rebuild)
        if self.store.missing(keys):
            return None
        return [self.store.get(k) for k in keys]

    def write_back(self, keys: list[str], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Store fresh encodings (online) and return them as a cache hit would read them."""
        if self.mode != "online" or self.store is None:
            return tensors
        out = []
        for k, t in zip(keys, tensors):
            self.store.add(k, t)
            out.append(storage_round_trip(t, self.store.storage))
        return out


class BatchCaches:
    """Text and latent lookups for host batches, keyed exactly as the cache stages key them."""

    def __init__(self, p: Params, catalogs: CatalogSet, text_dir, latent_dir,
                 text_identity: str, vae_identity: str):
        self.p, self.cs = p, catalogs
        self.text_id, self.vae_id = text_identity, vae_identity
        shard = p.cache.shard_mb << 20
        self.text = CacheView(TensorStore(text_dir, p.cache.dtype, shard, stage="cache_text")
                              if p.cache.text != "off" else None, p.cache.text, "kmoss cache_text")
        self.latents = CacheView(TensorStore(latent_dir, p.cache.dtype, shard, stage="cache_latents")
                                 if p.cache.latents != "off" else None, p.cache.latents,
                                 "kmoss cache_latents")
        self._pos = {int(u): i for i, u in enumerate(catalogs.uid)}
        self.failed = _read_failed(Path(latent_dir) / "failed.json")

    def usable(self, batch: HostBatch) -> list[int]:
        """Positions of the samples whose image did not fail in the latent cache fill."""
        if not self.failed or self.latents.mode == "off":
            return list(range(len(batch.captions)))
        return [i for i, k in enumerate(self.latent_keys(batch)) if k not in self.failed]

    def text_keys(self, batch: HostBatch) -> list[str]:
        return [text_key(self.text_id, self.p.cache.dtype, c) for c in batch.captions]

    def latent_keys(self, batch: HostBatch) -> list[str]:
        res, keys = self.p.resolution, []
        for uid, (h, w), box, flip in zip(batch.uids.tolist(), batch.hw.tolist(), batch.crops, batch.flips):
            row = self.cs.row(self._pos[uid])
            content = content_identity(row.extra.get("hash"), row.locator, row.w, row.h)
            keys.append(latent_key(content, self.vae_id, self.p.cache.dtype, (h * 16, w * 16), box,
                                   flip, background_name(res.background), row.has_alpha,
                                   res.resample, self.p.encoders.draw))
        return keys

    def masks(self, batch: HostBatch) -> list[torch.Tensor | None] | None:
        """Each sample's loss mask ``[h*w]`` (None: unmasked), or None where no sample of the
        batch has one (``data.masks``). Cached beside the latents, made from the files where
        the cache does not hold it (``online`` stores it; ``offline`` must hold it)."""
        keys = self.latent_keys(batch)
        wanted = []
        for uid, key in zip(batch.uids.tolist(), keys):
            pos = self._pos[uid]
            d, row = int(self.cs.dataset[pos]), self.cs.row(pos)
            source = mask_source(self.p.data.datasets[d].mask, row.extra, row.has_alpha)
            wanted.append(None if source is None else (mask_key(key, *source), d, row, source[0]))
        if not any(wanted):
            return None
        out: list[torch.Tensor | None] = []
        for i, w in enumerate(wanted):
            if w is None:
                out.append(None)
                continue
            key, d, row, kind = w
            hit = self.latents.read([key], lambda k: f"the loss mask of image uid "
                                    f"{batch.uids[i].item()} of batch {batch.index}")
            if hit is None:
                h, wd = batch.hw[i].tolist()
                src = self.p.data.datasets[d].args
                fresh = mask_tokens(kind, src.open(row.locator),
                                    src.open(mask_path(row.locator)) if kind == "file" else None,
                                    batch.crops[i], (h * 16, wd * 16), batch.flips[i],
                                    self.p.data.max_image_pixels, f"dataset {d} {row.locator}")
                hit = self.latents.write_back([key], [fresh])
            out.append(hit[0].float())
        return out

    def read_text(self, batch: HostBatch) -> list[torch.Tensor] | None:
        return self.text.read(self.text_keys(batch), lambda k: "a caption of batch "
                              f"{batch.index}: {batch.captions[self.text_keys(batch).index(k)]!r}")

    def read_latents(self, batch: HostBatch) -> list[torch.Tensor] | None:
        keys = self.latent_keys(batch)
        return self.latents.read(keys, lambda k: f"image uid {batch.uids[keys.index(k)].item()} of "
                                 f"batch {batch.index}")

    def contents(self) -> list[str]:
        """The content hashes of the offline caches (their manifests): what the data was
        encoded to, so that a run's identity changes with the pictures or the weights even
        where the plan does not (the same files, new pixels)."""
        from kohakumoss.artifacts import read_manifest

        return [read_manifest(view.store.dir, kind, made_by=stage).content_hash
                for view, kind, stage in ((self.text, "text_cache", "cache_text"),
                                          (self.latents, "latent_cache", "cache_latents"))
                if view.mode == "offline" and view.store is not None]

    def flush(self) -> None:
        for view in (self.text, self.latents):
            if view.store is not None and view.mode == "online":
                view.store.flush()


def _read_failed(path: Path) -> set[str]:
    """The keys of images that failed to decode in the latent fill (``failed.json``)."""
    if not path.is_file():
        return set()
    try:
        return set(json.loads(path.read_text(encoding="utf-8")))
    except (ValueError, TypeError):
        raise IntegrityError(f"{path} is unreadable; rebuild it with `kmoss cache_latents` "
                             f"(or `dvc repro`)") from None
