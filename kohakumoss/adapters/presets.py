"""Which layers an adapter trains: the targeting presets of ``docs/adapters.md#presets-and-targets``.

A preset is ``base[+modifier...]``; each part contributes module-path regexes, matched with
``re.match`` (anchored at the start, ``$`` at the end) exactly as LyCORIS matches its
``target_name`` list. Linear patterns get one LyCORIS module per matching ``nn.Linear``;
norm patterns are used only with ``train_norms``. Counts on the 42-block model: ``attn``
168, ``attn-mlp`` 252, ``full-block`` 262, ``all`` 269 linears.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

JOINT_ATTN = r"layers\.\d+\.proj\.(q|k|v|o)$"
JOINT_MLP = r"layers\.\d+\.proj\.(ffn_up_gate|ffn_down)$"
TEXT_BLOCK = r"text_embedder\.blocks\.\d+\.(qkv|proj|ffn_gate|ffn_up|ffn_down)$"
TEXT_PROJ = r"text_embedder\.proj$"
MODULATION = r"(shared_block_modulation|video_head_modulation|time_embedding\.\d+)$"
EMBED_HEAD = r"(video_embedder|final_linear_video)$"
JOINT_NORMS = r"layers\.\d+\.(norm1|norm2|q_norm|k_norm)$"
TEXT_NORMS = r"text_embedder\.blocks\.\d+\.(norm1|norm2|q_norm|k_norm)$"
FINAL_NORM = r"final_norm_video$"

# name -> (linear patterns, norm patterns)
BASES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "attn": ((JOINT_ATTN,), (JOINT_NORMS,)),
    "attn-mlp": ((JOINT_ATTN, JOINT_MLP), (JOINT_NORMS,)),
    "full-block": ((JOINT_ATTN, JOINT_MLP, TEXT_BLOCK), (JOINT_NORMS, TEXT_NORMS)),
    "all": ((JOINT_ATTN, JOINT_MLP, TEXT_BLOCK, TEXT_PROJ, MODULATION, EMBED_HEAD),
            (JOINT_NORMS, TEXT_NORMS, FINAL_NORM)),
}
MODIFIERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "text-refiner": ((TEXT_BLOCK, TEXT_PROJ), (TEXT_NORMS,)),
    "modulation": ((MODULATION,), ()),
    "embed": ((EMBED_HEAD,), (FINAL_NORM,)),
}
DEFAULT_PRESET = "attn-mlp"


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def preset_patterns(preset: str) -> tuple[list[str], list[str]]:
    """(linear regexes, norm regexes) of a preset string such as ``attn+modulation``."""
    base, *mods = [p.strip() for p in preset.split("+")]
    bad = [m for m in mods if m not in MODIFIERS]
    if base not in BASES or bad:
        raise ValueError(
            f"unknown adapter preset {preset!r}: a preset is base[+modifier...] with base one of "
            f"{', '.join(BASES)} and modifiers {', '.join('+' + m for m in MODIFIERS)} "
            f"(e.g. 'attn-mlp+modulation'); or list module-path regexes in adapter.targets")
    parts = [BASES[base]] + [MODIFIERS[m] for m in mods]
    return (_unique(p for lin, _ in parts for p in lin), _unique(p for _, nrm in parts for p in nrm))


def resolve_targets(cfg) -> list[str]:
    """The linear regexes of an ``AdapterConfig``: explicit ``targets`` replace the preset."""
    return list(cfg.targets) if cfg.targets else preset_patterns(cfg.preset)[0]


def resolve_norm_targets(cfg) -> list[str]:
    """The norm regexes trained with ``train_norms`` (explicit ``targets`` replace these too)."""
    return list(cfg.targets) if cfg.targets else preset_patterns(cfg.preset)[1]


def _matches(patterns: Sequence[str], name: str) -> bool:
    return name in patterns or any(re.match(p, name) for p in patterns)


def _shapes(names: Iterable[str]) -> str:
    """Module paths with block indices written as N: the valid names, compactly."""
    return ", ".join(_unique(re.sub(r"\.\d+(?=\.|$)", ".N", n) for n in names))


def targeted_paths(linears: Sequence[str], norms: Sequence[str], regexes: Sequence[str],
                   kind: str = "linear", check: bool = True) -> list[str]:
    """Paths of the ``kind`` ("linear" or "norm") modules matched by ``regexes``, among a
    model's Linear and RMSNormWeight module paths (``model.config.module_paths`` lists them
    without building the model).

    With ``check``, a regex that matches no Linear and no norm of the model is an error
    naming it and listing the model's valid module paths.
    """
    found = [n for n in (linears if kind == "linear" else norms) if _matches(regexes, n)]
    if check:
        known = [*linears, *norms]
        dead = [p for p in regexes if not any(_matches([p], n) for n in known)]
        if dead:
            raise ValueError(f"adapter target pattern(s) {dead} match no module of the model; "
                             f"patterns are Python regexes matched with re.match against module "
                             f"paths: {_shapes(known)}")
    return found


def targeted_modules(model, regexes: Sequence[str], kind: str = "linear", check: bool = True) -> list[str]:
    """``targeted_paths`` over a built model's modules (nn.Linear; RMSNormWeight: "norm")."""
    from torch import nn

    from kohakumoss.model.dit import RMSNormWeight

    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    norms = [n for n, m in model.named_modules() if isinstance(m, RMSNormWeight)]
    return targeted_paths(linears, norms, regexes, kind, check)
