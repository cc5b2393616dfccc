"""Data sources (``docs/data.md#sources``). Importing this package registers them all:
``kohya``, ``folder``, ``jsonl``, ``parquet``, ``webdataset`` and ``moss_shard``."""

from kohakumoss.data.sources import folder, jsonl, kohya, parquet, shards, webdataset  # noqa: F401
from kohakumoss.data.sources.base import SOURCES, Source, SourceError, register_source
from kohakumoss.data.sources.shards import import_to_shards

__all__ = ["SOURCES", "Source", "SourceError", "import_to_shards", "register_source"]
