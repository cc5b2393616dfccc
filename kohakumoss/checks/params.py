"""Checks that can run when params load, so a stage never starts work it cannot finish.

``check_adapter`` is pure config (the algorithm and its options go together, the preset
parses, the target regexes compile); ``check_weights`` reads only file headers and config
files (every weight path exists and holds what its key asks for); ``check_targets`` matches
the adapter's targets against the module paths of the configured transformer
(``DiTConfig.module_paths``: nothing built, no torch imported).
``kohakumoss.params.load_params`` runs all three, so ``kmoss scan`` refuses a LoKr on a path
that matches nothing before any image is read, instead of ``kmoss train`` refusing it after
the caches are built.
"""

from __future__ import annotations

import re
from pathlib import Path

from kohakumoss.adapters.options import check_options
from kohakumoss.adapters.presets import resolve_norm_targets, resolve_targets, targeted_paths
from kohakumoss.config import Params
from kohakumoss.configlib import ConfigError
from kohakumoss.model.config import FLAVORS, DiTConfig

TINY = "tiny"


def check_adapter(p: Params) -> None:
    """The adapter section on its own: algorithm x options, preset, target regexes."""
    if p.adapter.full:
        return
    where = f"{p.path}: adapter"
    try:
        check_options(p.adapter)
        patterns = resolve_targets(p.adapter) + (resolve_norm_targets(p.adapter)
                                                 if p.adapter.train_norms else [])
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"{where}.targets: {pattern!r} is not a valid regular expression "
                              f"({e}); targets are Python regexes matched against module paths "
                              f"such as layers.0.proj.q") from None


def transformer_config(p: Params) -> DiTConfig:
    """The configured transformer's shape: the tiny flavor, or read from the file headers."""
    path = p.model.transformer
    if path == TINY:
        return FLAVORS["tiny"]
    from kohakumoss.formats.model_files import read_config

    try:
        config, _ = read_config(path)
    except (ValueError, OSError) as e:
        raise ConfigError(f"{p.path}: model.transformer = {path!r}: {e}") from None
    return config


def _check_text_encoder(p: Params) -> None:
    path = p.model.text_encoder
    if path == TINY:
        return
    from kohakumoss.encoders.text import load_tokenizer, locate

    try:
        _, model_dir, _ = locate(Path(path), p.model.tokenizer)
        load_tokenizer(model_dir, p.model.tokenizer)
    except (ValueError, OSError) as e:
        raise ConfigError(f"{p.path}: model.text_encoder = {path!r}: {e}") from None


def _check_vae(p: Params) -> None:
    path = p.model.vae
    if path == TINY:
        return
    where = f"{p.path}: model.vae = {path!r}"
    fix = ("give 'tiny', a MOSS-Image pipeline folder (with vae/), its vae/ folder, or a ComfyUI "
           "vae/*.safetensors file")
    vae = Path(path)
    if not vae.exists():
        raise ConfigError(f"{where} does not exist; {fix}")
    if vae.is_file():
        if vae.suffix != ".safetensors":
            raise ConfigError(f"{where} is not a .safetensors file; {fix}")
        return
    folder = vae / "vae" if (vae / "vae").is_dir() else vae
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{where}: {folder} has no config.json; {fix}")


def _check_caption_tokenizer(p: Params) -> None:
    path = p.caption.tokenizer
    if path in ("", TINY) or Path(path).is_dir():
        return
    raise ConfigError(f"{p.path}: caption.tokenizer = {path!r} is not a folder; point it at a "
                      f"tokenizer folder (tokenizer.json + tokenizer_config.json with a chat "
                      f"template), 'tiny', or '' to estimate token counts")


WEIGHT_CHECKS = {"model.transformer": transformer_config, "model.text_encoder": _check_text_encoder,
                 "model.vae": _check_vae, "caption.tokenizer": _check_caption_tokenizer}


def check_weights(p: Params) -> DiTConfig:
    """Every weight path exists and holds its component; returns the transformer's shape."""
    config = transformer_config(p)
    for key, check in WEIGHT_CHECKS.items():
        if key != "model.transformer":
            check(p)
    return config


def weight_problems(p: Params) -> dict[str, str | None]:
    """Each weight key -> what is wrong with it (None when it is fine), all of them: what
    ``kmoss doctor`` shows, where ``check_weights`` stops at the first."""
    problems: dict[str, str | None] = {}
    for key, check in WEIGHT_CHECKS.items():
        try:
            check(p)
            problems[key] = None
        except ConfigError as e:
            problems[key] = str(e).removeprefix(f"{p.path}: ")
    return problems


def check_targets(p: Params, config: DiTConfig) -> None:
    """Every target regex matches a module of this transformer, and some linear is trained."""
    if p.adapter.full:
        return
    paths = config.module_paths()  # the model's, without building it (no torch)
    where = f"{p.path}: adapter"
    try:
        linears = targeted_paths(*paths, resolve_targets(p.adapter))
        if p.adapter.train_norms:
            targeted_paths(*paths, resolve_norm_targets(p.adapter), "norm", check=False)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    if not linears:
        raise ConfigError(f"{where}: the targets {resolve_targets(p.adapter)} select no linear "
                          f"layer of the transformer (only norms); add a linear's path such as "
                          f"layers.N.proj.q, or use a preset")


def check_params(p: Params) -> None:
    """Everything checkable before a stage works: the adapter, the weights, the targets."""
    check_adapter(p)
    check_targets(p, check_weights(p))
