"""The ``folder`` source: every image under a plain tree (``docs/data.md#folder``).

Depth-first, top-down: a directory's image files (sorted) come before its subdirectories
(sorted); symlinked directories are not entered. ``group`` is the relative directory
(``""`` for the root), the locator the relative path with ``/``. Sidecars and stamps are
those of the kohya source (``docs/data.md#sidecars-and-json-metadata``,
``docs/data.md#kohya``); weight is 1. An image name that is no readable file
(a broken or looping link) is a rejected row, after the folder's images.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from kohakumoss.data.rows import ScanLimits, WalkItem
from kohakumoss.data.sources.base import (
    SourceError,
    broken_item,
    check_args,
    list_dir,
    register_source,
    sidecar_file_item,
)


@register_source("folder")
@dataclasses.dataclass(frozen=True)
class FolderSource:
    path: str
    recursive: bool = True
    txt_as: Literal["tags", "nl"] = "tags"
    hash_content: bool = False

    def __post_init__(self) -> None:
        check_args(self)

    def walk(self, limits: ScanLimits = ScanLimits()) -> list[WalkItem]:
        root = Path(self.path)
        if not root.is_dir():
            raise SourceError(f"folder source: folder {str(root)!r} does not exist "
                              f"(resolved to {str(root.absolute())!r}); set path to a "
                              "directory of images (with optional img.txt / img.caption / "
                              "img.json sidecars)")
        items: list[WalkItem] = []
        self._walk_dir(root, "", items, limits)
        return items

    def _walk_dir(self, folder: Path, rel: str, items: list[WalkItem], limits: ScanLimits) -> None:
        listing = list_dir(folder, follow_dir_links=False)
        for entry in listing.images:
            locator = f"{rel}/{entry.name}" if rel else entry.name
            items.append(sidecar_file_item(entry, listing.present, locator, group=rel,
                                           txt_as=self.txt_as, hash_content=self.hash_content,
                                           limits=limits))
        for entry, error in listing.broken:
            items.append(broken_item(entry, f"{rel}/{entry.name}" if rel else entry.name, error,
                                     group=rel))
        if self.recursive:
            for sub in listing.dirs:
                self._walk_dir(Path(sub.path), f"{rel}/{sub.name}" if rel else sub.name, items,
                               limits)

    def open(self, locator: str) -> bytes:
        return (Path(self.path) / locator).read_bytes()

    def own_catalog(self) -> Path | None:
        return None
