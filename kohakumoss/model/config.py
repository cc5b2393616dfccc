"""The DiT's configuration, its named flavors, and the config read off a checkpoint's shapes.

``docs/model.md#configuration-and-flavors``. Flavors: ``base`` and ``sft`` (the published 5.08B
config; identical, only weights differ) and ``tiny`` (the reference vectors' test model,
also the embedded default of the pipeline).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class DiTConfig:
    dim: int = 3072
    depth: int = 42
    heads: int = 24
    ffn_dim: int = 8192
    text_dim: int = 4096
    text_blocks: int = 2
    latent_channels: int = 128
    freq_dim: int = 256
    rope_base: float = 10000.0
    rope_axes: int = 4
    eps: float = 1e-6
    time_scale: float = 1000.0
    negative_skip_layers: tuple[int, ...] = (22,)

    def __post_init__(self):
        if self.dim % self.heads:
            raise ValueError(f"dim {self.dim} is not divisible by heads {self.heads}")
        if self.head_dim % (2 * self.rope_axes):
            raise ValueError(f"head_dim {self.head_dim} is not divisible by 2 * rope_axes "
                             f"({2 * self.rope_axes})")
        if self.freq_dim % 2:
            raise ValueError(f"freq_dim {self.freq_dim} must be even")
        bad = [n for n in self.negative_skip_layers if not 0 <= n < self.depth]
        if bad:
            raise ValueError(f"negative_skip_layers {bad} outside [0, {self.depth})")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def rope_bands(self) -> int:
        return self.head_dim // (2 * self.rope_axes)

    def num_params(self) -> int:
        D, Dh, F, T, C, FD = self.dim, self.head_dim, self.ffn_dim, self.text_dim, \
            self.latent_channels, self.freq_dim
        text_block = 2 * D + 2 * Dh + 3 * D * D + 3 * D + D * D + D + 2 * (D * F + F) + F * D + D
        joint = 2 * D + 2 * Dh + 4 * D * D + 2 * D * F + F * D
        return (C * D + D + T * D + D + self.text_blocks * text_block + FD * D + 2 * D + D * D
                + 6 * D * D + 6 * D + self.depth * joint + D + D * C + 2 * D * D + 2 * D)

    def module_paths(self) -> tuple[list[str], list[str]]:
        """(Linear paths, RMSNormWeight paths) of ``MOSSImageTransformer(self)``, each in
        ``named_modules`` order, without building it (``kmoss scan`` checks adapter targets
        with no torch; ``tests/test_adapters.py`` holds this to the built model's)."""
        text_linears = ("qkv", "proj", "ffn_gate", "ffn_up", "ffn_down")
        joint_linears = ("q", "k", "v", "o", "ffn_up_gate", "ffn_down")
        norms = ("norm1", "norm2", "q_norm", "k_norm")
        linears = ["video_embedder", "text_embedder.proj",
                   *(f"text_embedder.blocks.{i}.{n}" for i in range(self.text_blocks) for n in text_linears),
                   "time_embedding.0", "time_embedding.2", "shared_block_modulation",
                   *(f"layers.{i}.proj.{n}" for i in range(self.depth) for n in joint_linears),
                   "final_linear_video", "video_head_modulation"]
        norm_paths = [*(f"text_embedder.blocks.{i}.{n}" for i in range(self.text_blocks) for n in norms),
                      *(f"layers.{i}.{n}" for i in range(self.depth) for n in norms),
                      "final_norm_video"]
        return linears, norm_paths

    def hf_config(self) -> dict:
        """The diffusers-style ``config.json`` of a transformer folder."""
        return {"_class_name": "MOSSImageTransformer", "_diffusers_version": "0.38.0",
                "dim": self.dim, "ffn_dim": self.ffn_dim, "freq_dim": self.freq_dim,
                "latent_channels": self.latent_channels, "num_heads": self.heads,
                "num_layers": self.depth, "rope_base": self.rope_base, "text_dim": self.text_dim}


FLAVORS: dict[str, DiTConfig] = {
    "base": DiTConfig(),
    "sft": DiTConfig(),
    "tiny": DiTConfig(dim=64, depth=3, heads=2, ffn_dim=128, text_dim=48, text_blocks=2,
                      latent_channels=128, freq_dim=256, negative_skip_layers=()),
}


def flavor(name: str) -> DiTConfig:
    if name not in FLAVORS:
        raise ValueError(f"unknown model flavor {name!r}; one of {', '.join(FLAVORS)}")
    return FLAVORS[name]


_LAYER = re.compile(r"^layers\.(\d+)\.")
_TEXT_QKV = re.compile(r"^text_embedder\.blocks\.(\d+)\.qkv\.weight$")


def infer_config(shapes: Mapping[str, Sequence[int]], hf_config: Mapping | None = None) -> DiTConfig:
    """The config of a checkpoint from its (official-named, unfused) tensor shapes.

    ``rope_base`` comes from a ``config.json`` when given; eps, time_scale and rope_axes are
    constants; the CFG skip set is block 22 for the 42-block model, else none.
    """
    need = ["shared_block_modulation.weight", "layers.0.q_norm.weight",
            "layers.0.proj.ffn_up_gate.weight", "text_embedder.proj.weight",
            "video_embedder.weight", "time_embedding.0.weight"]
    missing = [k for k in need if k not in shapes]
    if missing:
        raise ValueError(f"not a MOSS-Image transformer checkpoint: missing {', '.join(missing)}")
    dim = shapes["shared_block_modulation.weight"][0] // 6
    head_dim = shapes["layers.0.q_norm.weight"][0]
    depth = 1 + max(int(m.group(1)) for k in shapes if (m := _LAYER.match(k)))
    text_blocks = sum(1 for k in shapes if _TEXT_QKV.match(k))
    rope_base = float((hf_config or {}).get("rope_base", 10000.0))
    return DiTConfig(
        dim=dim, depth=depth, heads=dim // head_dim,
        ffn_dim=shapes["layers.0.proj.ffn_up_gate.weight"][0] // 2,
        text_dim=shapes["text_embedder.proj.weight"][1], text_blocks=text_blocks,
        latent_channels=shapes["video_embedder.weight"][1],
        freq_dim=shapes["time_embedding.0.weight"][1], rope_base=rope_base,
        negative_skip_layers=(22,) if depth == 42 else ())
