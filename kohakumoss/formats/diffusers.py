"""The diffusers transformer folder (``docs/formats.md``): ``config.json``, safetensors shards
in state-dict order and their index, the official split q/k/v keys
(``model_files.save_official``). Written whole in a temp folder beside the target and swapped
in, so an existing folder is replaced only by a complete one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from kohakumoss.formats.model_files import save_official
from kohakumoss.formats.reader import TransformerReader, locate
from kohakumoss.model.config import DiTConfig


def _replace_dir(tmp: Path, final: Path) -> None:
    """Swap a finished folder into place; the old one is removed only afterwards."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old)


def save_diffusers(state: Mapping[str, torch.Tensor], folder: str | Path, config: DiTConfig,
                   dtype: torch.dtype | None = torch.bfloat16) -> Path:
    """Write ``state`` as the folder ``folder`` (replacing it only once complete)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        save_official(state, tmp, config, dtype=dtype)
        _replace_dir(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return folder


def read_diffusers(folder: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The folder's weights by official name (``rope.bands`` left out), and its ``config.json``."""
    reader = TransformerReader(locate(folder))
    return {name: reader.tensor(name) for name in reader.names}, reader.files.hf_config or {}
