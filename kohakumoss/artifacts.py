"""Manifests, content hashes and atomic writes: the one place for all three.

Every stage output directory holds a ``manifest.json``:

- ``kind`` and ``schema``: what the artifact is and the layout version;
- ``key``: the hash of everything that determines it (the params the stage read, the
  content hashes of its input manifests, the code version);
- ``content_hash``: the hash of its own files, so two runs that produce the same bytes
  have the same identity (DVC sees no change, and a checkpoint can name the plan it used);
- ``files``: per-file content hashes, ``info``: a small human-readable summary.

Writes go to a temp file in the same directory, are fsynced, then renamed over the
target, so a killed process never leaves a half-written file under a final name. Files
end up 0644 and folders 0755 (less what the umask takes away), never the 0600 / 0700 of
``tempfile``, so a ComfyUI running as another user can read an export. Temp files are
named ``.<name>.<random>.tmp`` (folders ``.tmp-<random>``); ``sweep_temps`` removes the
ones a killed writer left, under ``dir_lock``, the one lock a writer of a directory
holds (a cache, a run), so two writers never interleave.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kohakumoss
from kohakumoss import portable
from kohakumoss.errors import KohakuError

MANIFEST = "manifest.json"
LOCK = ".kmoss.lock"


class ArtifactError(KohakuError, RuntimeError):
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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def public_mode(path: str | os.PathLike) -> None:
    """Give ``path`` the mode a plain ``open``/``mkdir`` would: 0666 / 0777 less the umask
    (0644 / 0755 with the usual 022); ``tempfile`` makes 0600 / 0700."""
    base = 0o777 if os.path.isdir(path) else 0o666
    os.chmod(path, base & ~_umask())


def temp_dir(parent: str | os.PathLike, prefix: str = ".tmp-") -> Path:
    """A fresh folder in ``parent`` for assembling an output, with the folder mode."""
    Path(parent).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    public_mode(tmp)
    return tmp


def make_dirs(path: str | os.PathLike) -> Path:
    """``mkdir -p`` (the folder mode follows the umask, like every folder we create)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside ``path``; on success fsync it and rename it over ``path``.

    On an exception the temp file is removed and ``path`` is left untouched. The result has
    the usual file mode (0644 under the usual umask).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        if tmp_path.is_file():
            with open(tmp_path, "rb+") as f:
                os.fsync(f.fileno())
        public_mode(tmp_path)
        os.replace(tmp_path, path)
        _fsync_dir(path.parent)
    finally:
        if tmp_path.is_dir():
            import shutil

            shutil.rmtree(tmp_path, ignore_errors=True)
        elif tmp_path.exists():
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


def write_safetensors(tensors: dict[str, Any], path: str | os.PathLike,
                      metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file`` with the same bytes for the same input every time.

    safetensors writes the ``__metadata__`` mapping in hash-map order, which changes from
    one process to the next, so equal exports, checkpoints and shards would hash apart
    (and DVC would re-run what follows them). The header is rewritten in place with the
    metadata keys sorted: the same length, so the tensor data never moves or is re-read.
    """
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    if not metadata or len(metadata) < 2:
        return
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        raw = f.read(size)
        header = json.loads(raw)
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        body = raw.rstrip(b" ")
        if len(text) != len(body):  # a serialisation we do not reproduce: keep it as written
            return
        f.seek(8)
        f.write(text + raw[len(body):])


def sweep_temps(directory: str | os.PathLike, recursive: bool = True) -> list[Path]:
    """Remove the temp files and folders killed writers left in ``directory`` (hold the
    directory's ``dir_lock`` first, so a live writer's temp files are never touched)."""
    import shutil

    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    pattern = "**/.*" if recursive else ".*"
    for p in directory.glob(pattern):
        name = p.name
        if not (name.startswith(".tmp-") or (name.startswith(".") and name.endswith(".tmp"))):
            continue
        found.append(p)
    for p in found:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return found


class LockBusy(KohakuError):
    """Another process holds the lock of a directory we must write."""


@contextlib.contextmanager
def dir_lock(directory: str | os.PathLike, what: str, wait: bool = True,
             poll: float = 0.5) -> Iterator[Path]:
    """Hold ``directory``/.kmoss.lock while writing ``directory`` (a cache, a run).

    Where the OS has advisory locks (``flock``: Linux, macOS) the kernel drops the lock when
    the holder dies, so a kill -9 leaves no stale lock; elsewhere (Windows) the lock is the
    file itself, made exclusively, and a holder found dead on this machine is taken over
    (``portable``). Either way the file names the holder. ``wait``: block until the other
    writer finishes (saying once who holds it), else raise ``LockBusy``. Stale temp files
    are swept once the lock is held. ``what`` names the writer in messages.
    """
    import logging

    directory = make_dirs(directory)
    path = directory / LOCK
    lock = _FlockLock(path) if portable.os_locks() is not None else _FileLock(path)
    told = False
    while not lock.acquire():
        holder = _lock_holder(path)
        if not wait:
            raise LockBusy(f"{directory} is being written by another {what} ({holder}); wait "
                           f"for it to finish, or stop it, then run this again")
        if not told:
            logging.getLogger(__name__).warning("%s is being written by another %s (%s); "
                                                "waiting for it to finish", directory, what, holder)
            told = True
        time.sleep(poll)
    try:
        lock.write(f"{os.getpid()} {portable.node_name()} {what}\n".encode())
        sweep_temps(directory)
        yield path
    finally:
        lock.release()


class _FlockLock:
    """``flock`` on the lock file: the kernel releases it with the descriptor or the process."""

    def __init__(self, path: Path):
        self.path, self.fd = path, os.open(path, os.O_RDWR | os.O_CREAT, 0o666)

    def acquire(self) -> bool:
        fcntl = portable.os_locks()
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def write(self, data: bytes) -> None:
        os.ftruncate(self.fd, 0)
        os.lseek(self.fd, 0, os.SEEK_SET)
        os.write(self.fd, data)

    def release(self) -> None:
        os.close(self.fd)  # closing the descriptor releases the lock


class _FileLock:
    """The lock file made exclusively (``O_EXCL``) and removed on release; one whose holder
    (its pid on this machine) no longer runs is stale and taken over."""

    def __init__(self, path: Path):
        self.path, self.fd = path, None

    def acquire(self) -> bool:
        for _ in range(2):  # a stale lock removed: one more try at once
            try:
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
                return True
            except FileExistsError:
                try:
                    seen = os.stat(self.path).st_ino
                except FileNotFoundError:
                    continue
                if not self._stale():
                    return False
                with contextlib.suppress(FileNotFoundError):
                    if os.stat(self.path).st_ino == seen:  # not another taker's new lock
                        os.unlink(self.path)
        return False

    def _stale(self) -> bool:
        try:
            pid, host = self.path.read_text().split()[:2]
        except (OSError, ValueError):  # being written this instant, or broken: its age decides
            try:
                return time.time() - self.path.stat().st_mtime > 10
            except OSError:
                return False
        return host == portable.node_name() and not portable.pid_alive(int(pid))

    def write(self, data: bytes) -> None:
        os.write(self.fd, data)
        os.fsync(self.fd)

    def release(self) -> None:
        os.close(self.fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _lock_holder(path: Path) -> str:
    try:
        pid, host = path.read_text().split()[:2]
        return f"pid {pid} on {host}"
    except (OSError, ValueError):
        return "pid unknown"
