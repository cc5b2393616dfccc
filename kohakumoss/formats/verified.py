"""Verified reads of a checkpoint's files: each file against the size and blake2b hash its
manifest records, a safetensors file hashed while it is read (once), its header's offsets
bounds-checked before anything is allocated. A mismatch raises ``Damaged`` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch

from kohakumoss.artifacts import hash_bytes
from kohakumoss.errors import IntegrityError

# the dtype names of a safetensors header -> torch
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool, "U16": torch.uint16,
          "U32": torch.uint32, "U64": torch.uint64, "F8_E4M3": torch.float8_e4m3fn,
          "F8_E5M2": torch.float8_e5m2}



class Damaged(IntegrityError):
    """A checkpoint file that is missing, unreadable or not what its manifest records."""

    def __init__(self, folder: Path, problem: str):
        self.folder, self.problem = folder, problem
        super().__init__(f"{problem}; the checkpoint {folder} is damaged: export or resume from "
                         f"another step (training skips a damaged newest checkpoint by itself), "
                         f"or delete it")


def size_problem(f: Path, entry: dict[str, Any]) -> str | None:
    try:
        size = f.stat().st_size
    except FileNotFoundError:
        return f"{f} is missing"
    if size != entry["size"]:
        return (f"{f} has {size} bytes, its manifest records {entry['size']} (truncated or "
                f"overwritten)")
    return None


def hash_problem(f: Path, digest: str, entry: dict[str, Any]) -> str | None:
    if digest != entry["blake2b"]:
        return f"{f} does not match the blake2b hash its manifest records (its bytes changed)"
    return None


def check_size(f: Path, entry: dict[str, Any]) -> None:
    if problem := size_problem(f, entry):
        raise Damaged(f.parent, problem)


def check_hash(f: Path, digest: str, entry: dict[str, Any]) -> None:
    if problem := hash_problem(f, digest, entry):
        raise Damaged(f.parent, problem)


def read_small(f: Path, entry: dict[str, Any]) -> bytes:
    check_size(f, entry)
    data = f.read_bytes()
    check_hash(f, hash_bytes(data), entry)
    return data


def parse_json(f: Path, data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError as e:
        raise Damaged(f.parent, f"{f} is not valid JSON ({e})") from None


def read_safetensors(f: Path, entry: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Read a safetensors file once, each tensor into its own memory, hashing the bytes as
    they come; the result is returned only if the hash matches. The (not yet verified)
    header's offsets are bounds-checked before anything is allocated."""
    check_size(f, entry)
    size, h, out = entry["size"], hashlib.blake2b(digest_size=16), {}  # = artifacts.hash_file

    def broken(why: str) -> Damaged:
        return Damaged(f.parent, f"{f} is not a whole safetensors file ({why})")

    with open(f, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 2 <= n <= size - 8:
            raise broken("bad header length")
        header_bytes = fh.read(n)
        h.update(head)
        h.update(header_bytes)
        try:
            header = json.loads(header_bytes)
            spans = sorted((int(v["data_offsets"][0]), int(v["data_offsets"][1]), k,
                            SAFETENSORS_DTYPES[v["dtype"]], [int(s) for s in v["shape"]])
                           for k, v in header.items() if k != "__metadata__")
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise broken(f"unreadable header: {e!r}") from None
        pos = 0
        for begin, end, name, dtype, shape in spans:
            if begin != pos or min(shape, default=0) < 0 or \
                    end - begin != math.prod(shape) * dtype.itemsize or 8 + n + end > size:
                raise broken(f"tensor {name!r} lies outside the file")
            t = torch.empty(shape, dtype=dtype)
            buf = t.reshape(-1).view(torch.uint8).numpy()
            if fh.readinto(buf) != len(buf):
                raise broken("ends early")
            h.update(buf)
            out[name], pos = t, end
        if 8 + n + pos != size:
            raise broken("bytes after the last tensor")
    check_hash(f, h.hexdigest(), entry)
    return out
