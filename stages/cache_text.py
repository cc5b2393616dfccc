"""`kmoss cache_text`: encode every caption the plan will use into the text cache."""

from __future__ import annotations

from pathlib import Path

import typer

from stages.common import PARAMS_OPTION, console, stage


@stage
def main(
    params: Path = PARAMS_OPTION,
    plan: Path = typer.Option(Path("artifacts/plan"), help="The plan directory."),
    out: Path = typer.Option(Path("artifacts/cache/text"), help="Text cache directory (persisted)."),
) -> None:
    """Encode each caption the plan trains on (and the empty caption) with the text encoder,
    into a content-keyed cache of large safetensors shards.

    Entries already cached are skipped (the encoder is not even loaded when nothing is
    missing); a killed run keeps its completed shards; corrupt shards are re-encoded.
    A second run on the same directory waits for the first, then finds its entries cached.
    """
    from kohakumoss.cache.build import build_text_cache
    from kohakumoss.params import load_params

    manifest, s = build_text_cache(load_params(params), plan, out)
    console.print(f"text cache {manifest.content_hash[:12]} ({manifest.info['encoder']}): "
                  f"{s.wanted} captions, {s.cached} cached, {s.encoded} encoded"
                  + (f", {len(s.dropped_shards)} corrupt shard(s) rebuilt" if s.dropped_shards else ""))


if __name__ == "__main__":
    typer.run(main)
