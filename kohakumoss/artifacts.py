"""Manifests, content hashes and atomic writes: the one place for all three.

Every stage output directory holds a ``manifest.json``:

- ``kind`` and ``schema``: what the artifact is and the layout version;
- ``key``: the hash of everything that determines it (the params the stage read, the
  content hashes of its input manifests, the code version);
- ``content_hash``: the hash of its own files, so two runs that produce the same bytes
  have the same identity (DVC sees no change, and a checkpoint can name the plan it used);
- ``files``: per-file content hashes, ``info``: a small human-readable summary.

Writes go to a temp file in the same directory, are fsynced, then renamed over the
target, so a killed process never leaves a half-written file under a final name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kohakumoss

MANIFEST = "manifest.json"


class ArtifactError(RuntimeError):
    """A missing or mismatched artifact; the message says which stage rebuilds it."""


def hash_bytes(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def hash_json(obj: Any) -> str:
    """Hash of the canonical JSON form (sorted keys, no whitespace) of ``obj``."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hash_bytes(text.encode("utf-8"))


def hash_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not supported on this platform
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside ``path``; on success fsync it and rename it over ``path``.

    On an exception the temp file is removed and ``path`` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
        _fsync_dir(path.parent)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def code_version(*modules: str) -> str:
    """Package version plus a hash of the named library modules' source files.

    ``modules`` are dotted names under ``kohakumoss`` (a package includes its whole tree).
    """
    root = Path(kohakumoss.__file__).parent
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(modules):
        rel = name.removeprefix("kohakumoss").lstrip(".").replace(".", "/")
        target = root / rel if rel else root
        files = sorted(target.rglob("*.py")) if target.is_dir() else [target.with_suffix(".py")]
        for f in files:
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return f"{kohakumoss.__version__}+{h.hexdigest()}"


@dataclasses.dataclass(frozen=True)
class Manifest:
    kind: str
    schema: int
    key: str
    params_hash: str
    inputs: dict[str, str]
    code_version: str
    content_hash: str
    files: dict[str, str]
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def make_manifest(kind: str, schema: int, *, params: dict[str, Any], inputs: dict[str, Manifest],
                  code: str, directory: str | os.PathLike, files: list[str],
                  info: dict[str, Any] | None = None) -> Manifest:
    """Build the manifest of ``files`` (paths relative to ``directory``)."""
    directory = Path(directory)
    file_hashes = {f: hash_file(directory / f) for f in sorted(files)}
    params_hash = hash_json(params)
    input_hashes = {name: m.content_hash for name, m in sorted(inputs.items())}
    key = hash_json({"kind": kind, "schema": schema, "params": params_hash,
                     "inputs": input_hashes, "code": code})
    return Manifest(kind=kind, schema=schema, key=key, params_hash=params_hash,
                    inputs=input_hashes, code_version=code,
                    content_hash=hash_json({"kind": kind, "files": file_hashes}),
                    files=file_hashes, info=info or {})


def write_manifest(directory: str | os.PathLike, manifest: Manifest) -> Path:
    path = Path(directory) / MANIFEST
    atomic_write_json(path, manifest.to_json())
    return path


def read_manifest(directory: str | os.PathLike, kind: str, *, made_by: str = "") -> Manifest:
    """Read and check ``directory``/manifest.json; ``made_by`` names the stage that rebuilds it."""
    path = Path(directory) / MANIFEST
    fix = f"; run `kmoss {made_by}` (or `dvc repro`) to build it" if made_by else ""
    if not path.is_file():
        raise ArtifactError(f"{path} is missing{fix}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        manifest = Manifest(**data)
    except (json.JSONDecodeError, TypeError) as e:
        raise ArtifactError(f"{path} is not a valid manifest ({e}){fix}") from None
    if manifest.kind != kind:
        raise ArtifactError(f"{path} holds a {manifest.kind!r} artifact, expected {kind!r}{fix}")
    return manifest


def verify_files(directory: str | os.PathLike, manifest: Manifest) -> list[str]:
    """Names of the manifest's files that are missing or whose bytes changed."""
    directory = Path(directory)
    bad = []
    for name, digest in manifest.files.items():
        p = directory / name
        if not p.is_file() or hash_file(p) != digest:
            bad.append(name)
    return bad
