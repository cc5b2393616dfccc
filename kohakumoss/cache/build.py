"""The cache stages' library side: plan -> keys -> fill the missing entries -> manifest.

Each cache is one persisted directory (``artifacts/cache/text``, ``artifacts/cache/latents``)
holding a ``TensorStore`` plus ``builds.json`` and ``manifest.json``. The encoder's
identity (id + compute spec) is known before any weight is loaded, so a re-run that finds
everything cached loads no encoder at all; once loaded, the encoder must report that same
identity or the fill is refused.
"""

from __future__ import annotations

from pathlib import Path

from kohakumoss.artifacts import (Manifest, atomic_write_json, code_version, make_manifest,
                                  write_manifest)
from kohakumoss.cache.fill import FillStats, fill_latents, fill_text, latent_items, record_build, text_items
from kohakumoss.cache.store import TensorStore
from kohakumoss.config import Params, stage_params
from kohakumoss.data.catalogset import load_catalogs
from kohakumoss.data.planfile import read_plan

TEXT_PARAMS = ["model.text_encoder", "model.tokenizer", "encoders.device", "encoders.text_dtype",
               "encoders.text_batch", "encoders.text_batch_tokens", "cache.dtype", "cache.shard_mb"]
LATENT_PARAMS = ["data.datasets", "resolution.background", "resolution.resample", "model.vae",
                 "encoders.device", "encoders.vae_dtype", "encoders.draw", "encoders.vae_batch",
                 "encoders.vae_batch_pixels", "encoders.decode_workers", "cache.dtype",
                 "cache.shard_mb"]
CODE = ("kohakumoss.cache", "kohakumoss.encoders", "kohakumoss.data.loader")


def text_identity(p: Params) -> str:
    from kohakumoss.encoders.text import TextEncoder

    return TextEncoder.identity(p.model.text_encoder, p.encoders.text_dtype, p.encoders.device)


def vae_identity(p: Params) -> str:
    from kohakumoss.encoders.vae import VAE

    return VAE.identity(p.model.vae, p.encoders.vae_dtype, p.encoders.device)


def _checked(encoder, expected: str):
    if encoder.key_id != expected:
        raise RuntimeError(f"the encoder reports identity {encoder.key_id!r} but the cache keys "
                           f"were computed for {expected!r}; refusing to write mismatched entries")
    return encoder


def _finish(kind: str, p: Params, keys: list[str], out: Path, inputs: dict[str, Manifest],
            stats: FillStats, identity: str) -> Manifest:
    record_build(out, {"encoder": identity, "storage": p.cache.dtype})
    (out / "failed.json").unlink(missing_ok=True)
    files = ["index.json", "builds.json"]
    if stats.failed:
        atomic_write_json(out / "failed.json", stats.failed)
        files.append("failed.json")
    manifest = make_manifest(kind, 1, params=stage_params(p, keys), inputs=inputs,
                             code=code_version(*CODE), directory=out, files=files,
                             info={"encoder": identity, "wanted": stats.wanted, "cached": stats.cached,
                                   "encoded": stats.encoded, "failed": len(stats.failed)})
    write_manifest(out, manifest)
    return manifest


def build_text_cache(p: Params, plan_dir: str | Path, out: str | Path) -> tuple[Manifest, FillStats]:
    from kohakumoss.encoders.text import TextEncoder

    out = Path(out)
    table, plan = read_plan(plan_dir)
    identity = text_identity(p)
    store = TensorStore(out, p.cache.dtype, p.cache.shard_mb << 20)
    items = text_items(table, identity, p.cache.dtype)

    def encoder():
        return _checked(TextEncoder.load(p.model.text_encoder, tokenizer=p.model.tokenizer,
                                         dtype=p.encoders.text_dtype, device=p.encoders.device), identity)

    stats = fill_text(store, items, encoder, p.encoders.text_batch, p.encoders.text_batch_tokens)
    return _finish("text_cache", p, TEXT_PARAMS, out, {"plan": plan}, stats, identity), stats


def build_latent_cache(p: Params, plan_dir: str | Path, catalog_dir: str | Path, out: str | Path
                       ) -> tuple[Manifest, FillStats]:
    from kohakumoss.encoders.vae import VAE

    out = Path(out)
    table, plan = read_plan(plan_dir)
    cs = load_catalogs(catalog_dir, p.data.datasets)
    identity = vae_identity(p)
    store = TensorStore(out, p.cache.dtype, p.cache.shard_mb << 20)
    items = latent_items(table, cs, p, identity)

    def encoder():
        return _checked(VAE.load(p.model.vae, dtype=p.encoders.vae_dtype, device=p.encoders.device),
                        identity)

    stats = fill_latents(store, items, p, encoder)
    return _finish("latent_cache", p, LATENT_PARAMS, out, {"plan": plan, "catalog": cs.manifest},
                   stats, identity), stats
