"""The weights a cache folder was filled from (``docs/caches.md#which-weights``).

Keys name an encoder by its id and compute dtype only, as the reference's do, so two
different sets of weights under one id (the demo pipeline's VAE and FLUX.2's, a retrained
text encoder) would share keys. ``weights.json`` in each cache folder maps every encoder id
(without its dtype: ``flux2-vae``) to the ``fingerprint`` of the files it was filled from:

- a fill from weights with another fingerprint than the recorded one empties the folder
  first (keys cannot tell which entries are stale), says so, and records the new one;
- training refuses a cache filled from other weights than its params name.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from kohakumoss.artifacts import atomic_write_json
from kohakumoss.cache.store import TensorStore
from kohakumoss.encoders.fingerprint import fingerprint
from kohakumoss.errors import IntegrityError

log = logging.getLogger(__name__)

RECORD = "weights.json"


@dataclasses.dataclass(frozen=True)
class Source:
    encoder: str  # the identity's id part: flux2-vae, qwen3.5-9b, flux2-vae-tiny
    fingerprint: str  # of the weight files; the id itself for the built-in tiny encoders
    files: tuple[str, ...]

    @classmethod
    def of(cls, identity: str, files: list[Path]) -> Source:
        encoder = identity.split("/")[0]
        return cls(encoder, fingerprint(files) if files else encoder, tuple(str(f) for f in files))

    def record(self) -> dict:
        return {"fingerprint": self.fingerprint, "files": list(self.files)}


def recorded(directory: Path) -> dict[str, dict]:
    path = Path(directory) / RECORD
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except ValueError:
        data = None
    if not isinstance(data, dict) or not all(isinstance(v, dict) and "fingerprint" in v
                                             for v in data.values()):
        raise IntegrityError(f"{path} is unreadable; delete the folder {Path(directory)} and "
                             f"run `dvc repro` (every entry is re-encoded)")
    return data


def claim(store: TensorStore, source: Source) -> int:
    """Record ``source`` for the store's folder (inside ``store.writing()``); when the folder
    was filled from other weights under the same id, empty it first. Returns the number of
    entries dropped."""
    seen = recorded(store.dir)
    old = seen.get(source.encoder)
    dropped = 0
    if old is not None and old["fingerprint"] != source.fingerprint:
        dropped = store.clear()
        log.warning("%s was filled from other %s weights (%s) than %s: its %d entries are "
                    "dropped and re-encoded", store.dir, source.encoder,
                    ", ".join(old.get("files", [])) or "?", ", ".join(source.files), dropped)
        seen = {}
    if seen.get(source.encoder) != source.record():
        store.dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(store.dir / RECORD, {**seen, source.encoder: source.record()})
    return dropped


def require(directory: Path, source: Source, stage: str) -> None:
    """Refuse a cache folder whose recorded weights for ``source.encoder`` are others."""
    old = recorded(directory).get(source.encoder)
    if old is not None and old["fingerprint"] != source.fingerprint:
        raise IntegrityError(
            f"{directory} was filled from other {source.encoder} weights "
            f"({', '.join(old.get('files', [])) or '?'}) than the params name "
            f"({', '.join(source.files)}); re-encode with `dvc repro -f {stage}` "
            f"(or `kmoss {stage}`)")
