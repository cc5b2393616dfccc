"""A content-keyed tensor store in a few large safetensors shards with an index.

Layout of a store directory::

    shard-00000.safetensors   many entries; tensor name = the entry's 32-hex key
                              (fp8 entries add "<key>.scale", a float32 scalar)
    index.json                {"schema", "shards": {name: {"bytes", "hash", "entries"}},
                               "entries": {key: [shard name, first-dim length]}}

Writers buffer entries and write one shard at a time (temp file, fsync, rename), then the
index (the same way): a killed fill keeps every completed shard, and a shard the index
does not name is an orphan that the next writer removes. ``verify`` re-hashes the shards
and drops any that is missing, truncated or changed, so its entries are re-encoded
instead of trusted. Storage dtypes: bf16 (default), fp16, fp32, fp8 (e4m3 with a per-entry
scale ``absmax / 448``); reads return bf16 unless asked otherwise.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kohakumoss.artifacts import atomic_path, atomic_write_json, hash_file
from kohakumoss.errors import KohakuError

log = logging.getLogger(__name__)

SCHEMA = 1
INDEX = "index.json"
STORAGE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
           "fp8": torch.float8_e4m3fn}


class CacheMiss(KohakuError, KeyError):
    """Entries an offline cache does not hold; the message names them and the rebuild."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


def to_storage(t: torch.Tensor, storage: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The stored form of ``t``: (codes, scale or None)."""
    if storage == "fp8":
        amax = t.detach().abs().max().float() if t.numel() else torch.tensor(0.0)
        scale = (amax / 448) if amax > 0 else torch.tensor(1.0)
        return (t.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale.reshape(())
    return t.detach().to(STORAGE[storage]).contiguous(), None


def from_storage(codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale).to(dtype) if scale is not None else codes.to(dtype)


def storage_round_trip(t: torch.Tensor, storage: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """What a store-then-load of ``t`` returns: online misses use it so that a later hit
    feeds the model bit-identical numbers."""
    return from_storage(*to_storage(t, storage), dtype)


class TensorStore:
    def __init__(self, directory: str | Path, storage: str = "bf16", shard_bytes: int = 256 << 20):
        if storage not in STORAGE:
            raise ValueError(f"cache storage dtype {storage!r}; one of {', '.join(STORAGE)}")
        self.dir = Path(directory)
        self.storage = storage
        self.shard_bytes = shard_bytes
        self.index = self._read_index()
        self._handles: dict[str, object] = {}
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0

    # -- index ---------------------------------------------------------------------------
    def _read_index(self) -> dict:
        path = self.dir / INDEX
        if path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                if data.get("schema") == SCHEMA:
                    return data
                log.warning("%s has schema %r; starting an empty cache", path, data.get("schema"))
            except json.JSONDecodeError:
                log.warning("%s is unreadable; starting an empty cache (shards are re-verified)", path)
        return {"schema": SCHEMA, "shards": {}, "entries": {}}

    def _write_index(self) -> None:
        atomic_write_json(self.dir / INDEX, self.index)

    def __contains__(self, key: str) -> bool:
        return key in self.index["entries"] or key in self._pending

    def __len__(self) -> int:
        return len(self.index["entries"])

    def lengths(self) -> dict[str, int]:
        return {k: v[1] for k, v in self.index["entries"].items()}

    def missing(self, keys: Iterable[str]) -> list[str]:
        return [k for k in dict.fromkeys(keys) if k not in self]

    # -- integrity -----------------------------------------------------------------------
    def verify(self, full: bool = True) -> list[str]:
        """Drop shards that are missing, truncated or (``full``) changed; remove orphans.
        Returns the names of the dropped shards."""
        self.dir.mkdir(parents=True, exist_ok=True)
        bad = []
        for name, info in list(self.index["shards"].items()):
            path = self.dir / name
            ok = path.is_file() and path.stat().st_size == info["bytes"]
            if ok and full:
                ok = hash_file(path) == info["hash"]
            if ok:
                try:
                    with safe_open(str(path), framework="pt") as f:
                        ok = len([k for k in f.keys() if not k.endswith(".scale")]) == info["entries"]
                except (SafetensorError, OSError):
                    ok = False
            if not ok:
                bad.append(name)
        for name in bad:
            log.warning("cache shard %s is missing or corrupt: its entries will be re-encoded",
                        self.dir / name)
            del self.index["shards"][name]
            self.index["entries"] = {k: v for k, v in self.index["entries"].items() if v[0] != name}
            (self.dir / name).unlink(missing_ok=True)
        for orphan in self.dir.glob("shard-*.safetensors"):
            if orphan.name not in self.index["shards"]:
                orphan.unlink()
        if bad:
            self._write_index()
        return bad

    # -- writing -------------------------------------------------------------------------
    def add(self, key: str, tensor: torch.Tensor) -> None:
        if key in self:
            return
        self._pending[key] = tensor.detach().cpu()
        self._pending_bytes += tensor.numel() * 2
        if self._pending_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        taken = {int(n[6:11]) for n in self.index["shards"]} | \
                {int(p.name[6:11]) for p in self.dir.glob("shard-*.safetensors")}
        name = f"shard-{(max(taken) + 1) if taken else 0:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for key, t in self._pending.items():
            codes, scale = to_storage(t, self.storage)
            tensors[key] = codes
            if scale is not None:
                tensors[f"{key}.scale"] = scale.float()
        path = self.dir / name
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata={"storage": self.storage})
        self.index["shards"][name] = {"bytes": path.stat().st_size, "hash": hash_file(path),
                                      "entries": len(self._pending)}
        for key, t in self._pending.items():
            self.index["entries"][key] = [name, int(t.shape[0]) if t.ndim else 1]
        self._write_index()
        self._pending, self._pending_bytes = {}, 0

    # -- reading -------------------------------------------------------------------------
    def _handle(self, shard: str):
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.dir / shard), framework="pt")
        return self._handles[shard]

    def get(self, key: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        if key in self._pending:
            return storage_round_trip(self._pending[key], self.storage, dtype)
        shard = self.index["entries"][key][0]
        h = self._handle(shard)
        scale = h.get_tensor(f"{key}.scale") if self.storage == "fp8" else None
        return from_storage(h.get_tensor(key), scale, dtype)

    def get_many(self, keys: list[str], describe: Callable[[str], str], rebuild: str,
                 dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
        """All ``keys`` or a ``CacheMiss`` naming how many are missing, the first one
        (``describe(key)``) and the command that builds them."""
        missing = self.missing(keys)
        if missing:
            raise CacheMiss(f"{len(missing)} of {len(set(keys))} entries are not in the cache "
                            f"{self.dir}; first missing: {describe(missing[0])} (key {missing[0]}). "
                            f"Build them with `{rebuild}` (or `dvc repro`), or set the cache mode "
                            f"to online")
        return [self.get(k, dtype) for k in keys]

    def close(self) -> None:
        self._handles.clear()
