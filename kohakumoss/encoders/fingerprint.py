"""Which weights stand behind an encoder id (``docs/caches.md#which-weights``).

Cache keys name an encoder by its id and compute dtype alone (``flux2-vae/bf16``), as the
reference's keys do, so caches stay interchangeable with it. The id says nothing of the
weights: a retrained VAE, or the demo pipeline's, has the same one. ``fingerprint`` names
the weight files themselves: blake2b-128 over each file's name and size and a sample of its
bytes (the first and last MiB and 16 evenly spaced 64 KiB blocks). It reads a few MiB even
of an 18 GB text encoder and tells any two trainings or files apart; an edit of a few bytes
between the sampled blocks goes unnoticed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

EDGE = 1 << 20
BLOCK = 64 << 10
BLOCKS = 16


def _spans(size: int) -> list[tuple[int, int]]:
    if size <= 2 * EDGE + BLOCKS * BLOCK:
        return [(0, size)]
    step = (size - 2 * EDGE) // (BLOCKS + 1)
    return [(0, EDGE), *((EDGE + (i + 1) * step, BLOCK) for i in range(BLOCKS)), (size - EDGE, EDGE)]


def fingerprint(files: Sequence[Path]) -> str:
    """The sampled content hash of ``files``, in the order given (32 hex characters)."""
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}\x1f{size}\n".encode())
        with open(f, "rb") as fh:
            for offset, n in _spans(size):
                fh.seek(offset)
                h.update(fh.read(n))
    return h.hexdigest()
