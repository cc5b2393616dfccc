"""What every data source provides, the source registry, and the shared probing helpers
(images themselves are opened and probed in ``images.py``).

A source is a frozen dataclass of its own arguments (so ``params.yaml`` validates it
strictly, like every other section) registered under a name with ``@register_source``.
It offers:

- ``walk(limits) -> list[WalkItem]``: cheap enumeration (stat only) for the incremental
  catalog; ``limits`` (``ScanLimits``, the ``data`` knobs) is bound into every probe;
- ``open(locator) -> bytes``: the encoded image bytes of one row, for the loader;
- ``own_catalog() -> Path | None``: a prebuilt catalog (native shards) used instead of a walk.

Sources are picklable and open files lazily, so loader workers can reopen them.

Hostile input never stops a scan: an image or sidecar that cannot be read, a header that
declares a decompression bomb, a caption that is not UTF-8 (under ``caption_errors:
skip``) or a broken symbolic link becomes a rejected row whose error names the file;
only ``caption_errors: strict`` fails the scan, with ``CaptionEncodingError``.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import io
import json
import os
import stat
import typing
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from kohakumoss.artifacts import hash_bytes as content_hash
from kohakumoss.artifacts import hash_file as file_content_hash
from kohakumoss.configlib import ConfigError, coerce
from kohakumoss.data.rows import (IMAGE_EXTENSIONS, MISSING, STAMP_LEN, Row,
                                  ScanLimits, WalkItem, cap_captions, split_tags)
from kohakumoss.data.sources.images import probe_image
from kohakumoss.errors import KohakuError

SIDECAR_EXTS = (".txt", ".caption", ".json")
MASK_SUFFIX = ".mask.png"  # kohya's loss mask beside an image: img.png -> img.mask.png


class SourceError(KohakuError, ValueError):
    """Bad source configuration or layout; the message names the path and the fix."""


class CaptionEncodingError(KohakuError, RuntimeError):
    """A caption that is not UTF-8 under ``data.caption_errors: strict`` (fails the scan)."""


@runtime_checkable
class Source(Protocol):
    name: ClassVar[str]

    def walk(self, limits: ScanLimits = ScanLimits()) -> list[WalkItem]: ...

    def open(self, locator: str) -> bytes: ...

    def own_catalog(self) -> Path | None: ...


SOURCES: dict[str, type] = {}


def register_source(name: str):
    def wrap(cls):
        cls.name = name
        SOURCES[name] = cls
        return cls

    return wrap


def stat_identity(path: Path, st: os.stat_result) -> str:
    return f"stat:{os.path.normcase(os.path.abspath(path))}:{st.st_size}:{st.st_mtime_ns}"


def is_image_name(name: str) -> bool:
    """An image file's name (a loss mask ``img.mask.png`` is its image's sidecar, not one)."""
    lower = name.lower()
    return lower.endswith(IMAGE_EXTENSIONS) and not lower.endswith(MASK_SUFFIX)


def apply_json_meta(row: Row, meta: dict[str, Any]) -> None:
    """The JSON mapping (``docs/data.md#sidecars-and-json-metadata``) applied onto ``row``
    in place."""
    rest: dict[str, Any] = {}
    for key, value in meta.items():
        if key == "tags":
            row.tags = split_tags(value) if isinstance(value, str) else [str(t) for t in value]
        elif key in ("caption", "text", "caption_nl"):
            continue
        elif key in ("artist", "rating"):
            setattr(row, key, None if value is None else str(value))
        else:
            rest[key] = value
    for key in ("caption", "text", "caption_nl"):
        if key in meta and meta[key] is not None:
            row.caption_nl = str(meta[key])
    if rest:
        row.json = {**(row.json or {}), **rest}


def apply_text(row: Row, text: str, txt_as: str) -> None:
    if txt_as == "tags":
        row.tags = split_tags(text)
    else:
        row.caption_nl = text.strip()


def decode_caption(data: bytes, where: str, policy: str, warnings: list[str]) -> str:
    """Caption bytes as UTF-8 text under ``data.caption_errors`` (``policy``). Bytes that are
    not UTF-8 fail the scan (strict: ``CaptionEncodingError``), reject the row (skip: a
    ``ValueError``), or become U+FFFD with a note in ``warnings`` (replace). ``where`` names
    the file."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        problem = f"{where}: invalid UTF-8 at byte {e.start} (data.caption_errors: {policy})"
    if policy == "strict":
        raise CaptionEncodingError(f"{problem}; fix the file, or set data.caption_errors to "
                                   "skip (leave the image out) or replace (decode as U+FFFD)")
    if policy == "skip":
        raise ValueError(problem)
    warnings.append(f"{problem}: decoded with U+FFFD")
    return data.decode("utf-8", errors="replace")


def unreadable(path: str | os.PathLike, e: OSError) -> str:
    """Why ``path`` cannot be read, naming it (a missing file, a broken or looping link...)."""
    if e.errno == errno.ELOOP:
        return f"{path} is a symbolic link loop"
    if e.errno == errno.ENOENT and os.path.islink(path):
        return f"{path} is a symbolic link to a missing file"
    if e.errno == errno.ENOENT:
        return f"file not found: {path}"
    return f"{path} is unreadable ({e.strerror})"


def entry_problem(path: str | os.PathLike) -> str:
    """Why a directory entry that should be a file (or a followed folder) cannot be read."""
    try:
        os.stat(path)
    except OSError as e:
        return unreadable(path, e)
    return f"{path} is not a regular file"


def read_sidecar(path: Path) -> bytes | None:
    """A sidecar's bytes, None when there is none. A sidecar name that exists but cannot be
    read (a directory, a FIFO, a broken or looping link, no permission) is a ``ValueError``
    naming it: its image is rejected rather than trained without its caption."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"sidecar {path} is not a regular file")
        return path.read_bytes()
    except FileNotFoundError as e:
        if os.path.islink(path):
            raise ValueError(f"sidecar {unreadable(path, e)}") from None
        return None
    except OSError as e:
        raise ValueError(f"sidecar {unreadable(path, e)}") from None


def stat_or_lstat(path: str | os.PathLike) -> tuple[int, int]:
    """(size, mtime_ns) of a file, else of the broken link itself, else ``(-1, -1)``."""
    for follow in (True, False):
        try:
            st = os.stat(path, follow_symlinks=follow)
            return st.st_size, st.st_mtime_ns
        except OSError:
            continue
    return MISSING


def sidecar_stamp(stem: Path, present: set[str]) -> tuple[int, ...]:
    """(size, mtime_ns) of the .txt/.caption/.json sidecars and the loss mask, (-1, -1) when
    absent."""
    out: list[int] = []
    for ext in (*SIDECAR_EXTS, MASK_SUFFIX):
        p = stem.with_name(stem.name + ext)
        out += stat_or_lstat(p) if os.path.normcase(p.name) in present else MISSING
    return tuple(out)


def apply_sidecars(row: Row, stem: Path, txt_as: str, caption_errors: str = "skip") -> None:
    """.txt (tags or nl), then .caption (nl), then .json (mapping); later ones win."""
    texts = {}
    for ext in SIDECAR_EXTS:
        path = stem.with_name(stem.name + ext)
        data = read_sidecar(path)
        if data is not None:
            texts[ext] = decode_caption(data, f"sidecar {path}", caption_errors, row.warnings)
    if ".txt" in texts:
        apply_text(row, texts[".txt"].strip(), txt_as)
    if ".caption" in texts:
        row.caption_nl = texts[".caption"].strip()
    if ".json" in texts:
        js = stem.with_name(stem.name + ".json")
        try:
            meta = json.loads(texts[".json"])
        except json.JSONDecodeError as e:
            raise ValueError(f"sidecar {js} is not valid JSON ({e})") from None
        if not isinstance(meta, dict):
            raise ValueError(f"sidecar {js} must hold a JSON object, got {type(meta).__name__}")
        apply_json_meta(row, meta)


def check_txt_as(txt_as: str, where: str = "") -> None:
    if txt_as not in ("tags", "nl"):
        prefix = f"{where}: " if where else ""
        raise SourceError(f"{prefix}txt_as must be 'tags' or 'nl', got {txt_as!r}")


def check_args(args: Any) -> None:
    """Validate a source built directly in code the way ``configlib.build`` validates one
    from params.yaml (types, ``Literal`` choices, ``knob`` checks); called by each source's
    ``__post_init__``. Raises ``SourceError`` naming the source kind and its path.
    """
    hints = typing.get_type_hints(type(args))
    where = f"{type(args).name} source {getattr(args, 'path', '')!r}"
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        try:
            coerce(hints[f.name], value, f"{where}: {f.name}")
        except ConfigError as e:
            raise SourceError(str(e)) from None
        check = f.metadata.get("check")
        if check is not None and not check(value):
            allowed = f.metadata.get("allowed") or "rejected by its check"
            raise SourceError(f"{where}: {f.name} = {value!r} is not allowed: {allowed}")


# ---- hashing shared by manifest sources (docs/data.md#jsonl, #parquet) -----------------

def line_hash(text: str) -> int:
    """blake2b-8 of the UTF-8 text, big-endian, shifted right by 1 (a signed 63-bit int)."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def pad_stamp(*values: int) -> tuple[int, ...]:
    """A stamp of ``STAMP_LEN`` ints: the given values followed by -1."""
    assert len(values) <= STAMP_LEN, values
    return tuple(values) + (-1,) * (STAMP_LEN - len(values))


def relative_locator(value: Any) -> str:
    """An image path from a manifest with backslashes normalised to ``/``."""
    return str(value).replace("\\", "/")


# ---- folder listing and file probes (docs/data.md#kohya, #folder) ---------------------

@dataclasses.dataclass
class Listing:
    """One ``scandir`` of a folder: image files and subfolders (sorted by name), the
    OS-case-normalised names present, used to test for sidecars without more stats, and
    the broken entries (sorted): image names that are no readable file (a broken or looping
    link, a FIFO) and, when links to folders are followed, links that resolve to nothing."""

    images: list[os.DirEntry]
    dirs: list[os.DirEntry]
    present: set[str]
    broken: list[tuple[os.DirEntry, str]]


def list_dir(path: Path, *, follow_dir_links: bool) -> Listing:
    images: list[os.DirEntry] = []
    dirs: list[os.DirEntry] = []
    present: set[str] = set()
    broken: list[tuple[os.DirEntry, str]] = []
    with os.scandir(path) as it:
        for entry in it:
            present.add(os.path.normcase(entry.name))
            wanted = is_image_name(entry.name)
            try:
                if entry.is_dir(follow_symlinks=follow_dir_links):
                    dirs.append(entry)
                elif wanted and entry.is_file():
                    images.append(entry)
                elif wanted or (follow_dir_links and entry.is_symlink()
                                and not os.path.exists(entry.path)):
                    broken.append((entry, entry_problem(entry.path)))
            except OSError as e:  # a symbolic link loop
                broken.append((entry, unreadable(entry.path, e)))
    images.sort(key=lambda e: e.name)
    dirs.sort(key=lambda e: e.name)
    broken.sort(key=lambda b: b[0].name)
    return Listing(images, dirs, present, broken)


def image_stem(path: Path) -> Path:
    """``dir/img.png`` -> ``dir/img``: the stem its sidecars hang off."""
    return path.with_name(path.name.rsplit(".", 1)[0])


def sidecar_file_item(entry: os.DirEntry, present: set[str], locator: str, **fields: Any
                      ) -> WalkItem:
    """Walk item of an image with sidecars: key = locator, stamp = (size, mtime_ns) of the
    image then of its .txt/.caption/.json (``docs/data.md#kohya``). ``fields`` go to
    ``probe_file``."""
    st = entry.stat()
    path = Path(entry.path).absolute()
    stamp = (st.st_size, st.st_mtime_ns) + sidecar_stamp(image_stem(path), present)
    return WalkItem(locator, stamp, functools.partial(probe_file, str(path), locator, **fields))


def error_rows(locator: str, error: str, **fields: Any) -> list[Row]:
    return [Row(locator, error=error, **fields)]


def broken_item(entry: os.DirEntry, locator: str, error: str, **fields: Any) -> WalkItem:
    """Walk item of a broken directory entry (``Listing.broken``): one rejected row, stamped
    with the entry's own (link) stats, so it is reported until it changes."""
    stamp = pad_stamp(*stat_or_lstat(entry.path))
    return WalkItem(locator, stamp, functools.partial(error_rows, locator, error, **fields))


def probe_file(path: str, locator: str, *, limits: ScanLimits = ScanLimits(), group: str = "",
               weight: float = 1.0, artist: str | None = None, txt_as: str | None = None,
               meta: dict[str, Any] | None = None, hash_content: bool = False,
               warnings: tuple[str, ...] = ()) -> list[Row]:
    """Probe one image file (header, and the data once with ``limits.verify_images``) into
    a one-row list; never raises for bad data (only ``CaptionEncodingError`` under
    ``caption_errors: strict``).

    ``txt_as`` set -> read the .txt/.caption/.json sidecars
    (``docs/data.md#sidecars-and-json-metadata``); ``meta`` -> apply the JSON mapping of a
    manifest record; captions are then capped (``cap_captions``). ``extra.hash`` is the stat
    fingerprint, or the content hash with ``hash_content`` (``docs/data.md#image-identity``).
    A missing, unreadable or oversized image, or a broken sidecar, gives a row with
    ``error`` set (naming the file) and a zero size. ``warnings`` are the walk's notes.
    """
    row = Row(locator, group=group, weight=weight, artist=artist, warnings=list(warnings))
    try:
        st = os.stat(path)
    except OSError as e:
        return [Row(locator, group=group, weight=weight, error=unreadable(path, e))]
    try:
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file")
        try:
            row.w, row.h, row.has_alpha = probe_image(path, limits.max_image_pixels,
                                                      limits.verify_images)
        except ValueError as e:
            raise ValueError(f"image {path}: {e}") from None
        if txt_as is not None:
            apply_sidecars(row, image_stem(Path(path)), txt_as, limits.caption_errors)
            mask = image_stem(Path(path)).with_name(image_stem(Path(path)).name + MASK_SUFFIX)
            if mask.is_file():  # its content names the cached mask (a new mask, a new entry)
                row.extra["mask"] = file_content_hash(str(mask))
        if meta:
            apply_json_meta(row, meta)
        cap_captions(row, limits.max_caption_chars)
        identity = file_content_hash(path) if hash_content else stat_identity(Path(path), st)
        row.extra["hash"] = identity
    except (ValueError, TypeError, OSError) as e:
        return [Row(locator, group=group, weight=weight, error=str(e))]
    return [row]


def probe_bytes(data: bytes | None, locator: str, limits: ScanLimits = ScanLimits(),
                **fields: Any) -> Row:
    """Probe in-memory image bytes (container sources); ``extra.hash`` = content hash.
    The caller applies the captions, then ``cap_captions``."""
    if not data:
        return Row(locator, error="no image bytes", **fields)
    try:
        w, h, alpha = probe_image(io.BytesIO(data), limits.max_image_pixels, limits.verify_images)
    except ValueError as e:
        return Row(locator, error=str(e), **fields)
    row = Row(locator, w=w, h=h, has_alpha=alpha, **fields)
    row.extra["hash"] = content_hash(data)
    return row
