"""The ``kohya`` source: kohya-style ``<repeats>_<name>`` folders (``docs/data.md#kohya``).

Only first-level subfolders of ``path`` are read (plus, with ``include_root``, the images
directly in ``path``, which come first). The folder's numeric prefix gives the row weight
(``repeat_prefix``), its remainder optionally the artist (``artist_from_folder``); every
image reads its ``.txt`` / ``.caption`` / ``.json`` sidecars
(``docs/data.md#sidecars-and-json-metadata``). Broken entries (an
image name that is no readable file, a first-level link that resolves to nothing or to a
folder enclosing the dataset) are rejected rows, so the scan report lists them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path
from typing import Literal

from kohakumoss.configlib import knob
from kohakumoss.data.rows import ScanLimits, WalkItem
from kohakumoss.data.sources.base import (
    SourceError,
    broken_item,
    check_args,
    is_image_name,
    list_dir,
    register_source,
    sidecar_file_item,
)

PREFIX_RE = re.compile(r"^((?:\d+_)+)(.*)$", re.DOTALL)
LAYOUT_HINT = ("expected layout: path/10_name/img.png + img.txt (first-level subfolders "
               "named <repeats>_<name>; images directly in path need include_root: true)")


def _valid_artist_rule(value: str | None) -> bool:
    if value is None or value == "name":
        return True
    try:
        re.compile(value)
    except re.error:
        return False
    return True


def parse_folder_name(name: str) -> tuple[list[int], str]:
    """``10_name`` -> ``([10], "name")``; ``2_5_style`` -> ``([2, 5], "style")``;
    a name without a numeric prefix -> ``([], name)``."""
    m = PREFIX_RE.match(name)
    if m is None:
        return [], name
    return [int(n) for n in m.group(1).rstrip("_").split("_")], m.group(2)


def repeats_of(numbers: list[int], rule: str) -> float:
    if not numbers or rule == "ignore":
        return 1.0
    if rule == "first":
        return float(numbers[0])
    return float(math.prod(numbers))


def artist_of(remainder: str, rule: str | None) -> str | None:
    """None -> no artist; "name" -> the remainder; else a regex searched in the remainder
    (its first capture group if it has groups, else the whole match)."""
    if rule is None:
        return None
    if rule == "name":
        return remainder or None
    m = re.search(rule, remainder)
    if m is None:
        return None
    return (m.group(1) if m.re.groups else m.group(0)) or None


@register_source("kohya")
@dataclasses.dataclass(frozen=True)
class KohyaSource:
    path: str
    repeat_prefix: Literal["first", "product", "ignore"] = "first"
    artist_from_folder: str | None = knob(
        None, check=_valid_artist_rule,
        allowed="null, 'name', or a regular expression (first group, else whole match)")
    txt_as: Literal["tags", "nl"] = "tags"
    hash_content: bool = False
    include_root: bool = False

    def __post_init__(self) -> None:
        check_args(self)

    def walk(self, limits: ScanLimits = ScanLimits()) -> list[WalkItem]:
        root = Path(self.path)
        if not root.is_dir():
            raise SourceError(f"kohya source: folder {str(root)!r} does not exist "
                              f"(resolved to {str(root.absolute())!r}); {LAYOUT_HINT}")
        top = list_dir(root, follow_dir_links=True)
        common = {"txt_as": self.txt_as, "hash_content": self.hash_content, "limits": limits}
        items: list[WalkItem] = []
        if self.include_root:
            for entry in top.images:
                items.append(sidecar_file_item(entry, top.present, entry.name, group="",
                                               weight=1.0, **common))
        for entry, error in top.broken:
            if self.include_root or (entry.is_symlink() and not is_image_name(entry.name)):
                items.append(broken_item(entry, entry.name, error))
        real_root = os.path.realpath(root)
        for folder in top.dirs:
            target = os.path.realpath(folder.path)
            if folder.is_symlink() and os.path.commonpath([target, real_root]) == target:
                items.append(broken_item(folder, folder.name, f"{folder.path} is a symbolic link "
                                         f"to {target}, which holds the dataset: a loop, not "
                                         "entered"))
                continue
            numbers, remainder = parse_folder_name(folder.name)
            weight = repeats_of(numbers, self.repeat_prefix)
            artist = artist_of(remainder, self.artist_from_folder)
            sub = list_dir(Path(folder.path), follow_dir_links=False)  # subfolders are not read
            for entry in sub.images:
                items.append(sidecar_file_item(entry, sub.present, f"{folder.name}/{entry.name}",
                                               group=folder.name, weight=weight, artist=artist,
                                               **common))
            for entry, error in sub.broken:
                items.append(broken_item(entry, f"{folder.name}/{entry.name}", error,
                                         group=folder.name, weight=weight))
        if not items:
            raise SourceError(f"kohya source: no images found in {str(root)!r}; {LAYOUT_HINT}")
        return items

    def open(self, locator: str) -> bytes:
        return (Path(self.path) / locator).read_bytes()

    def own_catalog(self) -> Path | None:
        return None
