"""The cache stages' library side: plan -> keys -> fill the missing entries -> manifest.

Each cache is one persisted directory (``artifacts/cache/text``, ``artifacts/cache/latents``)
holding a ``TensorStore`` plus ``builds.json`` and ``manifest.json``, written under the
directory's lock (a second fill waits for the first, then finds its entries cached). The
encoder's identity (id + compute spec) is known before any weight is loaded, so a re-run
that finds everything cached loads no encoder at all; once loaded, the encoder must report
that same identity or the fill is refused.

The manifest is a function of what training will read, never of how the fill went or of
what merely produced it: its ``content_hash`` covers the encoder identity, the storage
dtype, the sorted (key, entry digest) pairs of the entries this plan wants and
``failed.json``; not ``index.json`` (which shard holds what), ``builds.json`` (every fill's
settings), entries of older plans, the fill's counts (printed, not recorded), nor the
stage's other params, input manifests or code version (``dvc.lock`` records those): an
identical cache is an identical manifest, and nothing downstream re-runs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import kohakumoss
from kohakumoss import faults
from kohakumoss.artifacts import Manifest, atomic_write_json, hash_json, make_manifest, write_manifest
from kohakumoss.cache.fill import FillStats, fill_latents, fill_text, latent_items, record_build, text_items
from kohakumoss.cache.store import TensorStore
from kohakumoss.cache.weights import Source, claim, require
from kohakumoss.config import Params
from kohakumoss.data.catalogset import load_catalogs
from kohakumoss.data.planfile import read_plan, read_validation

# the params each stage reads (dvc.yaml declares them; the manifest does not record them)
TEXT_PARAMS = ["model.text_encoder", "model.tokenizer", "encoders.device", "encoders.text_dtype",
               "encoders.text_precision",
               "encoders.text_batch", "encoders.text_batch_tokens", "cache.dtype", "cache.shard_mb"]
LATENT_PARAMS = ["data.datasets", "data.max_image_pixels", "resolution.background", "resolution.resample", "model.vae",
                 "encoders.device", "encoders.vae_dtype", "encoders.draw", "encoders.vae_batch",
                 "encoders.vae_batch_pixels", "encoders.decode_workers", "cache.dtype",
                 "cache.shard_mb"]
SCHEMA = 2  # content_hash over the wanted entries' digests (1: over index.json and builds.json)


def text_identity(p: Params) -> str:
    from kohakumoss.encoders.text import TextEncoder

    return TextEncoder.identity(p.model.text_encoder, p.encoders.text_dtype, p.encoders.device,
                                p.encoders.text_precision)


def vae_identity(p: Params) -> str:
    from kohakumoss.encoders.vae import VAE

    return VAE.identity(p.model.vae, p.encoders.vae_dtype, p.encoders.device)


def text_source(p: Params) -> Source:
    from kohakumoss.encoders.text import TextEncoder

    return Source.of(text_identity(p), TextEncoder.weight_files(p.model.text_encoder, p.model.tokenizer))


def vae_source(p: Params) -> Source:
    from kohakumoss.encoders.vae import VAE

    return Source.of(vae_identity(p), VAE.weight_files(p.model.vae))


def check_sources(p: Params, text_dir: str | Path, latent_dir: str | Path) -> None:
    """Before training reads the caches: an offline cache must have been filled from the
    weights the params name; an online one (written while training) is claimed for them."""
    for mode, directory, source, stage in ((p.cache.text, text_dir, text_source, "cache_text"),
                                           (p.cache.latents, latent_dir, vae_source, "cache_latents")):
        if mode == "offline":
            require(Path(directory), source(p), stage)
        elif mode == "online":
            store = TensorStore(directory, p.cache.dtype, stage=stage)
            with store.writing():
                claim(store, source(p))


def _checked(encoder, expected: str):
    if encoder.key_id != expected:
        raise RuntimeError(f"the encoder reports identity {encoder.key_id!r} but the cache keys "
                           f"were computed for {expected!r}; refusing to write mismatched entries")
    return encoder


def _finish(kind: str, p: Params, out: Path, store: TensorStore, items: dict, stats: FillStats,
            identity: str) -> Manifest:
    record_build(out, {"encoder": identity, "storage": p.cache.dtype})
    (out / "failed.json").unlink(missing_ok=True)
    files = []
    if stats.failed:
        atomic_write_json(out / "failed.json", stats.failed)
        files.append("failed.json")
    shaping = {"encoder": identity, "storage": p.cache.dtype}
    manifest = make_manifest(kind, SCHEMA, params=shaping, inputs={}, code=kohakumoss.__version__,
                             directory=out, files=files,
                             info={**shaping, "entries": len(items) - len(stats.failed),
                                   "failed": len(stats.failed)})
    entries = store.content_digest(k for k in items if k not in stats.failed)
    content = hash_json({"kind": kind, **shaping, "entries": entries, "files": manifest.files})
    manifest = dataclasses.replace(manifest, content_hash=content)
    faults.point("cache.manifest")
    write_manifest(out, manifest)
    return manifest


def _with_validation(plan_dir: str | Path):
    """The plan's rows and its held-out rows: the caches hold what training and validation read."""
    import pyarrow as pa

    table, _ = read_plan(plan_dir)
    return pa.concat_tables([table, read_validation(plan_dir)])


def build_text_cache(p: Params, plan_dir: str | Path, out: str | Path) -> tuple[Manifest, FillStats]:
    from kohakumoss.encoders.text import TextEncoder

    out = Path(out)
    table = _with_validation(plan_dir)
    identity = text_identity(p)
    store = TensorStore(out, p.cache.dtype, p.cache.shard_mb << 20, stage="cache_text")
    items = text_items(table, identity, p.cache.dtype)

    def encoder():
        return _checked(TextEncoder.load(p.model.text_encoder, tokenizer=p.model.tokenizer,
                                         dtype=p.encoders.text_dtype, device=p.encoders.device,
                                         stream=p.encoders.text_stream,
                                         precision=p.encoders.text_precision), identity)

    with store.writing():
        claim(store, text_source(p))
        stats = fill_text(store, items, encoder, p.encoders.text_batch, p.encoders.text_batch_tokens)
        manifest = _finish("text_cache", p, out, store, items, stats, identity)
    return manifest, stats


def build_latent_cache(p: Params, plan_dir: str | Path, catalog_dir: str | Path, out: str | Path
                       ) -> tuple[Manifest, FillStats]:
    from kohakumoss.encoders.vae import VAE

    out = Path(out)
    table = _with_validation(plan_dir)
    cs = load_catalogs(catalog_dir, p.data.datasets)
    identity = vae_identity(p)
    store = TensorStore(out, p.cache.dtype, p.cache.shard_mb << 20, stage="cache_latents")
    items = latent_items(table, cs, p, identity)

    def encoder():
        return _checked(VAE.load(p.model.vae, dtype=p.encoders.vae_dtype, device=p.encoders.device),
                        identity)

    with store.writing():
        claim(store, vae_source(p))
        stats = fill_latents(store, items, p, encoder)
        manifest = _finish("latent_cache", p, out, store, items, stats, identity)
    return manifest, stats
