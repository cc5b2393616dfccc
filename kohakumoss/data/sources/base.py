"""What every data source provides, the source registry, and the shared probing helpers.

A source is a frozen dataclass of its own arguments (so ``params.yaml`` validates it
strictly, like every other section) registered under a name with ``@register_source``.
It offers:

- ``walk() -> list[WalkItem]``: cheap enumeration (stat only) for the incremental catalog;
- ``open(locator) -> bytes``: the encoded image bytes of one row, for the loader;
- ``own_catalog() -> Path | None``: a prebuilt catalog (native shards) used instead of a walk.

Sources are picklable and open files lazily, so loader workers can reopen them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
import typing
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from PIL import Image, UnidentifiedImageError

from kohakumoss.artifacts import hash_bytes as content_hash
from kohakumoss.artifacts import hash_file as file_content_hash
from kohakumoss.configlib import ConfigError, coerce
from kohakumoss.data.rows import IMAGE_EXTENSIONS, MISSING, STAMP_LEN, Row, WalkItem, split_tags
from kohakumoss.errors import KohakuError

ALPHA_MODES = {"RGBA", "LA", "PA", "RGBa", "La"}
EXIF_ORIENTATION = 0x0112
SIDECAR_EXTS = (".txt", ".caption", ".json")


class SourceError(KohakuError, ValueError):
    """Bad source configuration or layout; the message names the path and the fix."""


@runtime_checkable
class Source(Protocol):
    name: ClassVar[str]

    def walk(self) -> list[WalkItem]: ...

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
    return name.lower().endswith(IMAGE_EXTENSIONS)


def probe_image(fp: str | os.PathLike | io.BytesIO | Any) -> tuple[int, int, bool]:
    """Header-only probe: (w, h, has_alpha) after EXIF orientation. Never decodes pixels.

    Raises ``ValueError`` with the reason for an unreadable file.
    """
    try:
        with Image.open(fp) as im:
            w, h = im.size
            mode = im.mode
            alpha = mode in ALPHA_MODES or (mode == "P" and "transparency" in im.info)
            try:
                orientation = im.getexif().get(EXIF_ORIENTATION, 1)
            except Exception:  # a broken EXIF block does not make the image unusable
                orientation = 1
    except UnidentifiedImageError as e:
        raise ValueError(f"not a recognised image ({e})") from None
    except (OSError, SyntaxError) as e:
        raise ValueError(f"unreadable image header ({e})") from None
    if w <= 0 or h <= 0:
        raise ValueError(f"image has an empty size {w}x{h}")
    if orientation in (5, 6, 7, 8):
        w, h = h, w
    return w, h, alpha


def apply_json_meta(row: Row, meta: dict[str, Any]) -> None:
    """The JSON mapping of ``spec/data.md`` 2.1 applied onto ``row`` in place."""
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


def read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def sidecar_stamp(stem: Path, present: set[str]) -> tuple[int, ...]:
    """(size, mtime_ns) of the .txt/.caption/.json sidecars, (-1, -1) when absent."""
    out: list[int] = []
    for ext in SIDECAR_EXTS:
        p = stem.with_name(stem.name + ext)
        if os.path.normcase(p.name) in present:
            st = p.stat()
            out += [st.st_size, st.st_mtime_ns]
        else:
            out += list(MISSING)
    return tuple(out)


def apply_sidecars(row: Row, stem: Path, txt_as: str) -> None:
    """.txt (tags or nl), then .caption (nl), then .json (mapping); later ones win."""
    txt = stem.with_name(stem.name + ".txt")
    if txt.is_file():
        apply_text(row, read_text(txt).strip(), txt_as)
    cap = stem.with_name(stem.name + ".caption")
    if cap.is_file():
        row.caption_nl = read_text(cap).strip()
    js = stem.with_name(stem.name + ".json")
    if js.is_file():
        try:
            meta = json.loads(read_text(js))
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


# ---- hashing shared by manifest sources (spec 3.3 / 3.4) -------------------------------

def line_hash(text: str) -> int:
    """blake2b-8 of the UTF-8 text, big-endian, shifted right by 1 (a signed 63-bit int)."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def stat_pair(path: str | os.PathLike) -> tuple[int, int]:
    """(size, mtime_ns) of a file, ``(-1, -1)`` when it does not exist."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return MISSING
    return st.st_size, st.st_mtime_ns


def pad_stamp(*values: int) -> tuple[int, ...]:
    """A stamp of ``STAMP_LEN`` ints: the given values followed by -1."""
    assert len(values) <= STAMP_LEN, values
    return tuple(values) + (-1,) * (STAMP_LEN - len(values))


def relative_locator(value: Any) -> str:
    """An image path from a manifest with backslashes normalised to ``/``."""
    return str(value).replace("\\", "/")


# ---- folder listing and file probes (spec 3.1 / 3.2) -----------------------------------

@dataclasses.dataclass
class Listing:
    """One ``scandir`` of a folder: image files and subfolders (sorted by name) and the
    OS-case-normalised names present, used to test for sidecars without more stats."""

    images: list[os.DirEntry]
    dirs: list[os.DirEntry]
    present: set[str]


def list_dir(path: Path, *, follow_dir_links: bool) -> Listing:
    images: list[os.DirEntry] = []
    dirs: list[os.DirEntry] = []
    present: set[str] = set()
    with os.scandir(path) as it:
        for entry in it:
            present.add(os.path.normcase(entry.name))
            if entry.is_dir(follow_symlinks=follow_dir_links):
                dirs.append(entry)
            elif is_image_name(entry.name) and entry.is_file():
                images.append(entry)
    images.sort(key=lambda e: e.name)
    dirs.sort(key=lambda e: e.name)
    return Listing(images, dirs, present)


def image_stem(path: Path) -> Path:
    """``dir/img.png`` -> ``dir/img``: the stem its sidecars hang off."""
    return path.with_name(path.name.rsplit(".", 1)[0])


def sidecar_file_item(entry: os.DirEntry, present: set[str], locator: str, **fields: Any
                      ) -> WalkItem:
    """Walk item of an image with sidecars: key = locator, stamp = (size, mtime_ns) of the
    image then of its .txt/.caption/.json (spec 3.1). ``fields`` go to ``probe_file``."""
    st = entry.stat()
    path = Path(entry.path).absolute()
    stamp = (st.st_size, st.st_mtime_ns) + sidecar_stamp(image_stem(path), present)
    return WalkItem(locator, stamp, functools.partial(probe_file, str(path), locator, **fields))


def probe_file(path: str, locator: str, *, group: str = "", weight: float = 1.0,
               artist: str | None = None, txt_as: str | None = None,
               meta: dict[str, Any] | None = None, hash_content: bool = False) -> list[Row]:
    """Probe one image file (header only) into a one-row list; never raises for bad data.

    ``txt_as`` set -> read the .txt/.caption/.json sidecars (2.1); ``meta`` -> apply the
    JSON mapping of a manifest record. ``extra.hash`` is the stat fingerprint, or the
    content hash with ``hash_content`` (9.2). A missing or unreadable image, or a broken
    sidecar, gives a row with ``error`` set and a zero size.
    """
    row = Row(locator, group=group, weight=weight, artist=artist)
    try:
        st = os.stat(path)
    except OSError:
        return [Row(locator, group=group, weight=weight, error=f"file not found: {path}")]
    try:
        row.w, row.h, row.has_alpha = probe_image(path)
        if txt_as is not None:
            apply_sidecars(row, image_stem(Path(path)), txt_as)
        if meta:
            apply_json_meta(row, meta)
        identity = file_content_hash(path) if hash_content else stat_identity(Path(path), st)
        row.extra["hash"] = identity
    except (ValueError, TypeError, OSError) as e:
        return [Row(locator, group=group, weight=weight, error=str(e))]
    return [row]


def probe_bytes(data: bytes | None, locator: str, **fields: Any) -> Row:
    """Probe in-memory image bytes (container sources); ``extra.hash`` = content hash."""
    if not data:
        return Row(locator, error="no image bytes", **fields)
    try:
        w, h, alpha = probe_image(io.BytesIO(data))
    except ValueError as e:
        return Row(locator, error=str(e), **fields)
    row = Row(locator, w=w, h=h, has_alpha=alpha, **fields)
    row.extra["hash"] = content_hash(data)
    return row
