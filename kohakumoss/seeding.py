"""Coordinate-keyed randomness: every random decision gets a fresh generator.

``seed_of(*parts)`` is blake2b with a native 8-byte digest over the UTF-8 of ``repr(parts)``,
read little-endian; ``rng_of(*parts)`` is a numpy ``Generator(PCG64(seed_of(*parts)))``.
No running random stream exists anywhere in the data pipeline, so any batch, caption or
crop can be recomputed from its coordinates alone (``docs/data.md#seeding``).
"""

from __future__ import annotations

import hashlib

import numpy as np


def seed_of(*parts: object) -> int:
    digest = hashlib.blake2b(repr(parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def rng_of(*parts: object) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(seed_of(*parts)))
