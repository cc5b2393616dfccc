"""The merged model file (``docs/formats.md``): the base model with an adapter merged in at a
strength (or a full finetune's weights) as one transformer file, in ComfyUI's layout (fused
q/k/v, ``model_files.save_comfy``) or, with ``fused_qkv=False``, the official split keys.
The strength is in the metadata (``kohakumoss_strength``); the file loads as any base model.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from kohakumoss.formats.model_files import save_comfy
from kohakumoss.formats.reader import TransformerReader, locate
from kohakumoss.model.config import DiTConfig


def merged_state(model: nn.Module, adapters=None, strength: float = 1.0) -> dict[str, torch.Tensor]:
    """``model``'s weights with ``adapters`` (an ``AdapterSet`` or ``Attached`` on it; None: the
    weights as they are) merged in at ``strength``; the model is left as it was."""
    if adapters is None:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    adapters.merge(strength)
    try:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        adapters.unmerge()


def save_merged(state: Mapping[str, torch.Tensor], path: str | Path, config: DiTConfig, *,
                dtype: torch.dtype | None = torch.bfloat16, fused_qkv: bool = True,
                strength: float = 1.0, metadata: Mapping[str, str] | None = None) -> Path:
    """Write the merged file atomically; ``metadata`` gains ``kohakumoss_strength``."""
    return save_comfy(state, path, config, dtype=dtype, fused=fused_qkv,
                      metadata={**(metadata or {}), "kohakumoss_strength": str(strength)})


def read_merged(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A merged file's weights under official (split q/k/v) names (``rope.bands`` left out),
    and its metadata."""
    reader = TransformerReader(locate(path))
    return {name: reader.tensor(name) for name in reader.names}, dict(reader.metadata)
