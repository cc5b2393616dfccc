"""A content-keyed tensor store in a few large safetensors shards with an index.

Layout of a store directory::

    shard-00000.safetensors   many entries; tensor name = the entry's 32-hex key
                              (fp8 entries add "<key>.scale", a float32 scalar)
    index.json                {"schema": 2, "shards": {name: {"bytes", "hash", "entries"}},
                               "entries": {key: [shard name, first-dim length, digest]}}
    .kmoss.lock               held (``dir_lock``) by the one process writing the directory

An entry's digest (``entry_digest``: its stored dtype, shape, bytes and fp8 scale) names its
content whichever shard holds it, so ``content_digest`` of a set of keys does not depend on
how a fill went (killed and resumed, repaired, re-run): which entries share a shard does.

Writers hold the directory's lock (``writing``; ``flush`` and ``verify`` take it when the
caller does not) and re-read the index once they hold it, so two writers never encode an
entry twice or take each other's fresh shard for an orphan. A shard, then the index, is
written atomically (temp file, fsync, rename): a killed fill keeps every completed shard,
and a shard the index does not name is an orphan the next writer removes. ``verify`` (every
fill) checks each shard's size and every entry's digest and drops the shards that are
missing, truncated or changed, so their entries are re-encoded instead of trusted. Reads
check a shard's size the first time a process opens it and the digest of every entry read
(hashing only the bytes read): a mismatch is an ``IntegrityError`` naming the shard and the
command that re-encodes it, never silently wrong numbers.

Storage dtypes: bf16 (default), fp16, fp32, fp8 (e4m3 with a per-entry scale
``absmax / 448``); reads return bf16 unless asked otherwise.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from kohakumoss import faults
from kohakumoss.artifacts import atomic_write_bytes, atomic_write_json, dir_lock, hash_bytes, hash_file
from kohakumoss.errors import IntegrityError, KohakuError

log = logging.getLogger(__name__)

SCHEMA = 2
LEGACY = 1  # entries without digests: the next fill's ``verify`` adds them (no re-encoding)
INDEX = "index.json"
SHARD = re.compile(r"shard-(\d+)\.safetensors")
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
        return (t.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale.reshape(()).float()
    return t.detach().to(STORAGE[storage]).contiguous(), None


def from_storage(codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale).to(dtype) if scale is not None else codes.to(dtype)


def storage_round_trip(t: torch.Tensor, storage: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """What a store-then-load of ``t`` returns: online misses use it so that a later hit
    feeds the model bit-identical numbers."""
    return from_storage(*to_storage(t, storage), dtype)


def _raw(t: torch.Tensor):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def entry_digest(codes: torch.Tensor, scale: torch.Tensor | None = None) -> str:
    """blake2b-128 of a stored entry: dtype, shape, the codes' bytes and the fp8 scale's."""
    h = hashlib.blake2b(f"{codes.dtype}{tuple(codes.shape)}".encode(), digest_size=16)
    h.update(_raw(codes))
    if scale is not None:
        h.update(_raw(scale))
    return h.hexdigest()


def _check_index(data: dict) -> None:
    """Raise ValueError/TypeError/KeyError unless ``data`` is a consistent index."""
    if data["schema"] not in (LEGACY, SCHEMA):
        raise ValueError(f"schema {data['schema']!r}, expected {SCHEMA}")
    shards, entries = data["shards"], data["entries"]
    if not isinstance(shards, dict) or not isinstance(entries, dict):
        raise TypeError("shards and entries must be objects")
    if not all(isinstance(i["bytes"], int) and isinstance(i["hash"], str) for i in shards.values()):
        raise TypeError("a shard's bytes or hash is not recorded")
    width = 2 if data["schema"] == LEGACY else 3
    if any(len(e) != width for e in entries.values()):
        raise ValueError("an entry has the wrong number of fields")
    counts = Counter(e[0] for e in entries.values())
    if counts != Counter({n: int(i["entries"]) for n, i in shards.items() if int(i["entries"])}):
        raise ValueError("the entries do not match the shards' entry counts")


class TensorStore:
    """``stage`` names the command that writes the directory (``cache_text``): it names the
    lock's holder and is the fix an ``IntegrityError`` gives."""

    def __init__(self, directory: str | Path, storage: str = "bf16", shard_bytes: int = 256 << 20,
                 stage: str | None = None):
        if storage not in STORAGE:
            raise ValueError(f"cache storage dtype {storage!r}; one of {', '.join(STORAGE)}")
        self.dir = Path(directory)
        self.storage = storage
        self.shard_bytes = shard_bytes
        self.stage = stage
        self.index, self._problem = self._read_index()
        self._handles: dict[str, object] = {}
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._held = 0

    def _fix(self) -> str:
        cmd = f"`kmoss {self.stage}`" if self.stage else "`kmoss cache_text` / `kmoss cache_latents`"
        return f"re-encode it with {cmd} (or `dvc repro`)"

    # -- index ---------------------------------------------------------------------------
    def _read_index(self) -> tuple[dict, str | None]:
        """(index, None), or (an empty index, what is wrong with the file)."""
        empty = {"schema": SCHEMA, "shards": {}, "entries": {}}
        path = self.dir / INDEX
        if not path.is_file():
            return empty, None
        try:
            data = json.loads(path.read_bytes())
            _check_index(data)
        except (ValueError, TypeError, KeyError, IndexError) as e:  # incl. JSON / UTF-8 errors
            return empty, f"the cache index {path} is unreadable, truncated or inconsistent ({e})"
        return data, None

    def _require_index(self) -> None:
        if self._problem:
            raise IntegrityError(f"{self._problem}; rebuild the cache with "
                                 f"{self._fix().removeprefix('re-encode it with ')}: its shards "
                                 f"are re-verified and re-encoded")

    def _write_index(self) -> None:
        atomic_write_json(self.dir / INDEX, self.index)

    def __contains__(self, key: str) -> bool:
        return key in self.index["entries"] or key in self._pending

    def __len__(self) -> int:
        return len(self.index["entries"])

    def lengths(self) -> dict[str, int]:
        return {k: v[1] for k, v in self.index["entries"].items()}

    def missing(self, keys: Iterable[str]) -> list[str]:
        self._require_index()
        return [k for k in dict.fromkeys(keys) if k not in self]

    def content_digest(self, keys: Iterable[str]) -> str:
        """Hash of the sorted (key, entry digest) pairs of ``keys`` (all stored, digested)."""
        entries = self.index["entries"]
        h = hashlib.blake2b(digest_size=16)
        for k in sorted(keys):
            assert len(entries[k]) == 3, "content_digest of an entry without a digest"
            h.update(f"{k}:{entries[k][2]}\n".encode())
        return h.hexdigest()

    # -- the writer's lock ---------------------------------------------------------------
    @contextlib.contextmanager
    def writing(self) -> Iterator[TensorStore]:
        """Hold the directory's lock (waiting for another writer to finish; re-entrant);
        once held, the index is re-read, as another writer may have added shards."""
        if self._held:
            self._held += 1
            try:
                yield self
            finally:
                self._held -= 1
            return
        with dir_lock(self.dir, self.stage or "cache writer"):
            self.index, self._problem = self._read_index()
            self._handles.clear()
            self._held = 1
            try:
                yield self
            finally:
                self._held = 0

    # -- integrity -----------------------------------------------------------------------
    def verify(self, full: bool = True) -> list[str]:
        """Drop shards that are missing, truncated or (``full``) hold changed entries; remove
        orphans; an unreadable index drops every shard. Returns the dropped shards' names."""
        with self.writing():
            dirty = self._problem is not None
            if self._problem:
                log.warning("%s; every shard is dropped and its entries are re-encoded", self._problem)
                self._problem = None
            by_shard: dict[str, list[str]] = {name: [] for name in self.index["shards"]}
            for key, e in self.index["entries"].items():
                by_shard[e[0]].append(key)
            bad = [name for name, keys in by_shard.items() if not self._shard_ok(name, keys, full)]
            for name in bad:
                log.warning("cache shard %s is missing, truncated or corrupt: its %d entries "
                            "will be re-encoded", self.dir / name, len(by_shard[name]))
                del self.index["shards"][name]
                for key in by_shard[name]:
                    del self.index["entries"][key]
                (self.dir / name).unlink(missing_ok=True)
            for orphan in self.dir.iterdir():
                if SHARD.fullmatch(orphan.name) and orphan.name not in self.index["shards"]:
                    log.info("removing %s, a shard the index does not name (a killed write)", orphan)
                    orphan.unlink()
            if self.index["schema"] == LEGACY and all(len(e) == 3 for e in self.index["entries"].values()):
                self.index["schema"], dirty = SCHEMA, True
            if bad or dirty:
                self._write_index()
            return bad

    def _shard_ok(self, name: str, keys: list[str], full: bool) -> bool:
        path = self.dir / name
        info = self.index["shards"][name]
        if not path.is_file() or path.stat().st_size != info["bytes"]:
            return False
        if not full:
            return True
        entries = self.index["entries"]
        legacy = any(len(entries[k]) == 2 for k in keys)
        if legacy and hash_file(path) != info["hash"]:  # digests are only added to trusted bytes
            return False
        try:
            with safe_open(str(path), framework="pt") as f:
                if {k for k in f.keys() if not k.endswith(".scale")} != set(keys):
                    return False
                for key in keys:
                    digest = entry_digest(*self._read_entry(f, key))
                    if len(entries[key]) == 2:
                        entries[key].append(digest)
                    elif entries[key][2] != digest:
                        return False
        except (SafetensorError, OSError):
            return False
        return True

    # -- writing -------------------------------------------------------------------------
    def clear(self) -> int:
        """Drop every entry and shard; the index goes first, so a kill in between leaves
        orphans the next writer removes. Returns how many entries there were."""
        with self.writing():
            count, shards = len(self.index["entries"]), list(self.index["shards"])
            self.index, self._problem = {"schema": SCHEMA, "shards": {}, "entries": {}}, None
            self._write_index()
            self._handles.clear()
            for name in shards:
                (self.dir / name).unlink(missing_ok=True)
            return count

    def add(self, key: str, tensor: torch.Tensor) -> None:
        if key in self:
            return
        self._pending[key] = tensor.detach().cpu()
        self._pending_bytes += tensor.numel() * 2
        if self._pending_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        """Write the pending entries (those another writer has not stored meanwhile) as one
        shard, then the index, under the directory's lock."""
        if not self._pending:
            return
        with self.writing():
            self._require_index()
            pending = {k: t for k, t in self._pending.items() if k not in self.index["entries"]}
            if pending:
                self._write_shard(pending)
            self._pending, self._pending_bytes = {}, 0

    def _write_shard(self, pending: dict[str, torch.Tensor]) -> None:
        taken = [int(m.group(1)) for n in [*self.index["shards"], *(p.name for p in self.dir.iterdir())]
                 if (m := SHARD.fullmatch(n))]
        name = f"shard-{max(taken, default=-1) + 1:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        entries: dict[str, list] = {}
        for key, t in pending.items():
            codes, scale = to_storage(t, self.storage)
            tensors[key] = codes
            if scale is not None:
                tensors[f"{key}.scale"] = scale
            entries[key] = [name, int(t.shape[0]) if t.ndim else 1, entry_digest(codes, scale)]
        # serialised here and written by Python, so a full disk is an OSError (ENOSPC/EFBIG)
        # the CLI reports in one line, not safetensors' own error; and hashed without a re-read
        data = save(tensors, metadata={"storage": self.storage})
        atomic_write_bytes(self.dir / name, data)
        faults.point("cache.shard")  # the shard in place, the index not yet naming it
        self.index["shards"][name] = {"bytes": len(data), "hash": hash_bytes(data), "entries": len(entries)}
        self.index["entries"].update(entries)
        self._write_index()

    # -- reading -------------------------------------------------------------------------
    def _read_entry(self, f, key: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        return f.get_tensor(key), (f.get_tensor(f"{key}.scale") if self.storage == "fp8" else None)

    def _handle(self, shard: str):
        """The open shard; its size is checked against the index the first time."""
        if shard not in self._handles:
            path = self.dir / shard
            want = self.index["shards"][shard]["bytes"]
            size = path.stat().st_size if path.is_file() else None
            if size != want:
                state = ("missing" if size is None else
                         f"truncated or changed ({size} bytes, the index records {want})")
                raise IntegrityError(f"cache shard {path} is {state}; {self._fix()}")
            try:
                self._handles[shard] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as e:
                raise IntegrityError(f"cache shard {path} is corrupt ({e}); {self._fix()}") from None
        return self._handles[shard]

    def get(self, key: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The entry ``key``, its stored bytes checked against the digest the index records."""
        if key in self._pending:
            return storage_round_trip(self._pending[key], self.storage, dtype)
        self._require_index()
        shard, _, *digest = self.index["entries"][key]
        path = self.dir / shard
        try:
            codes, scale = self._read_entry(self._handle(shard), key)
        except (SafetensorError, OSError) as e:
            raise IntegrityError(f"cache shard {path} is corrupt ({e}); {self._fix()}") from None
        if not digest:
            raise IntegrityError(f"the cache index {self.dir / INDEX} predates per-entry digests; "
                                 f"{self._fix().replace('re-encode it', 'upgrade it')} once (nothing "
                                 f"is re-encoded)")
        if entry_digest(codes, scale) != digest[0]:
            raise IntegrityError(f"cache shard {path} is corrupt: entry {key} does not match the "
                                 f"digest {self.dir / INDEX} records; {self._fix()}")
        return from_storage(codes, scale, dtype)

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
