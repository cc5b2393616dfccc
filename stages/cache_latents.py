"""`kmoss cache_latents`: encode every crop the plan will use into the latent cache."""

from __future__ import annotations

from pathlib import Path

import typer

from stages.common import PARAMS_OPTION, console, stage


@stage
def main(
    params: Path = PARAMS_OPTION,
    plan: Path = typer.Option(Path("artifacts/plan"), help="The plan directory."),
    catalog: Path = typer.Option(Path("artifacts/catalog"), help="The scan's catalog directory."),
    out: Path = typer.Option(Path("artifacts/cache/latents"), help="Latent cache directory (persisted)."),
) -> None:
    """Decode and VAE-encode each (image, target size, crop, flip) the plan trains on into a
    content-keyed cache of packed latent tokens (h*w x 128), same-size images batched.

    Entries already cached are skipped; a killed run keeps its completed shards; corrupt
    shards are re-encoded; an image that fails to decode is reported and skipped.
    A second run on the same directory waits for the first, then finds its entries cached.
    """
    from kohakumoss.cache.build import build_latent_cache
    from kohakumoss.params import load_params

    manifest, s = build_latent_cache(load_params(params), plan, catalog, out)
    console.print(f"latent cache {manifest.content_hash[:12]} ({manifest.info['encoder']}): "
                  f"{s.wanted} crops, {s.cached} cached, {s.encoded} encoded"
                  + (f", {len(s.failed)} failed (see {out}/failed.json)" if s.failed else "")
                  + (f", {len(s.dropped_shards)} corrupt shard(s) rebuilt" if s.dropped_shards else ""))


if __name__ == "__main__":
    typer.run(main)
