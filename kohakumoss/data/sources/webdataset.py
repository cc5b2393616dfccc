"""The ``webdataset`` source: samples inside uncompressed .tar files (``docs/data.md#webdataset``).

``path`` is a glob of tars (sorted; the position in that list is the tar index). Members
group by sample key = directory + basename up to the first dot; the extension is the rest,
lower-cased (``a.seg.png`` -> key ``a``, ext ``.seg.png``). A sample's image is its plain
image member (``.png``, ...; first sorted) else the first sorted dotted extension ending in
an image suffix; ``.txt`` gives tags or a caption (``txt_as``), ``.json`` the JSON mapping
(both decoded under ``data.caption_errors``).
Locator ``<tar index>:<data offset>:<size>`` (random access by seek); one walk item per
tar, key ``tar:<abs path>``, stamp ``(tar index, size, mtime_ns, -1 x 5)``.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import logging
import os
import tarfile
from pathlib import Path
from typing import Literal

from kohakumoss.data.rows import IMAGE_EXTENSIONS, Row, ScanLimits, WalkItem, cap_captions
from kohakumoss.data.sources.base import (
    SourceError,
    apply_json_meta,
    apply_text,
    check_args,
    decode_caption,
    pad_stamp,
    probe_bytes,
    register_source,
)

log = logging.getLogger(__name__)


def split_member(name: str) -> tuple[str, str]:
    """``dir/a.seg.png`` -> (``dir/a``, ``.seg.png``): key up to the first dot of the
    basename, extension (lower-cased) after it."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    key = f"{folder}/{stem}" if folder else stem
    return key, (dot + ext).lower()


def choose_image(exts: list[str]) -> str | None:
    """The image extension of a sample: a plain image extension first (sorted), else the
    first sorted dotted extension whose last suffix is an image extension."""
    ordered = sorted(exts)
    for ext in ordered:
        if ext in IMAGE_EXTENSIONS:
            return ext
    for ext in ordered:
        if ext.endswith(IMAGE_EXTENSIONS):
            return ext
    return None


def member_text(tf: tarfile.TarFile, member: tarfile.TarInfo, row: Row, policy: str) -> str:
    """A text member as UTF-8 under ``data.caption_errors`` (``policy``)."""
    return decode_caption(tf.extractfile(member).read(), f"{tf.name} member {member.name}",
                          policy, row.warnings)


def probe_tar(path: str, tar_index: int, txt_as: str, limits: ScanLimits = ScanLimits()
              ) -> list[Row]:
    """All samples of one tar; a bad member or sidecar gives an error row naming it, never
    raises (only ``CaptionEncodingError`` under ``caption_errors: strict``)."""
    policy = limits.caption_errors
    group = os.path.basename(path)
    rows: list[Row] = []
    try:
        with tarfile.open(path, "r:") as tf:
            samples: dict[str, dict[str, tarfile.TarInfo]] = {}
            for member in tf:
                if member.isfile():
                    key, ext = split_member(member.name)
                    samples.setdefault(key, {})[ext] = member
            for key, members in samples.items():
                ext = choose_image(list(members))
                if ext is None:
                    log.warning("webdataset %s: sample %r has no image member (%s); skipped",
                                path, key, ", ".join(sorted(members)))
                    continue
                image = members[ext]
                locator = f"{tar_index}:{image.offset_data}:{image.size}"
                row = probe_bytes(tf.extractfile(image).read(), locator, limits, group=group)
                row.extra["key"] = key
                if row.error is not None:
                    row.error = f"{path} member {image.name}: {row.error}"
                else:
                    try:
                        if ".txt" in members:
                            text = member_text(tf, members[".txt"], row, policy)
                            apply_text(row, text.strip(), txt_as)
                        if ".json" in members:
                            meta = json.loads(member_text(tf, members[".json"], row, policy))
                            if not isinstance(meta, dict):
                                raise ValueError(f"{key}.json must hold a JSON object")
                            apply_json_meta(row, meta)
                        cap_captions(row, limits.max_caption_chars)
                    except (ValueError, TypeError) as e:
                        row = Row(locator, group=group, error=f"sample {key!r}: {e}",
                                  extra={"key": key})
                rows.append(row)
    except (OSError, tarfile.TarError) as e:
        rows.append(Row(f"{tar_index}:0:0", group=group, error=f"unreadable tar {path} ({e})"))
    return rows


@functools.lru_cache(maxsize=16)
def _tar_paths(pattern: str) -> tuple[str, ...]:
    return tuple(sorted(glob.glob(pattern)))


@register_source("webdataset")
@dataclasses.dataclass(frozen=True)
class WebdatasetSource:
    path: str
    txt_as: Literal["tags", "nl"] = "tags"

    def __post_init__(self) -> None:
        check_args(self)

    def _pattern(self) -> str:
        return os.path.abspath(self.path)

    def tars(self) -> list[str]:
        """The sorted, absolute tar paths the glob matches now (not cached)."""
        paths = sorted(glob.glob(self._pattern()))
        if not paths:
            raise SourceError(f"webdataset source: glob {self.path!r} matches no file "
                              f"(resolved to {self._pattern()!r}); set path to a glob of "
                              "uncompressed .tar files, e.g. data/shard-*.tar")
        for p in paths:
            if not p.endswith(".tar"):
                raise SourceError(f"webdataset source: {p!r} is not an uncompressed .tar "
                                  "(random access needs plain tars); decompress it or narrow "
                                  f"the glob {self.path!r} to *.tar")
        return paths

    def walk(self, limits: ScanLimits = ScanLimits()) -> list[WalkItem]:
        items = []
        for index, p in enumerate(self.tars()):
            st = os.stat(p)
            probe = functools.partial(probe_tar, p, index, self.txt_as, limits)
            items.append(WalkItem(f"tar:{p}", pad_stamp(index, st.st_size, st.st_mtime_ns), probe))
        return items

    def open(self, locator: str) -> bytes:
        index, offset, size = (int(v) for v in locator.split(":"))
        paths = _tar_paths(self._pattern())
        if index >= len(paths):
            paths = tuple(self.tars())
        with open(paths[index], "rb") as f:
            f.seek(offset)
            data = f.read(size)
        if len(data) != size:
            raise ValueError(f"webdataset {paths[index]}: short read at {locator}")
        return data

    def own_catalog(self) -> Path | None:
        return None
