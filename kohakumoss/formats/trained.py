"""A training checkpoint applied to a model: ``load_trained`` is the one reader of what a
checkpoint trained (``state.json``'s ``trained``), for sampling, previews and exports
(``docs/training.md``, ``docs/exports.md``).

The checkpoint is opened through ``open_checkpoint`` (every file verified as it is read,
never a pickle; an old-format checkpoint opens for its weights only). A full finetune's
weights are loaded into the model; an adapter is built on it (``apply_adapters``) and its
state loaded. With ``ema`` the EMA averages are used: for an adapter they cover the trained
parameters, the frozen rest (T-LoRA's base factors, alphas) comes from the trained state.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from kohakumoss.adapters import AdapterSet, apply_adapters
from kohakumoss.config import AdapterConfig
from kohakumoss.configlib import ConfigError, build
from kohakumoss.errors import KohakuError
from kohakumoss.formats.checkpoint import open_checkpoint


class TrainedError(KohakuError, ValueError):
    """A checkpoint that does not say what it trained, or lacks the weights asked for."""


@dataclasses.dataclass
class Trained:
    """What ``load_trained`` applied: the checkpoint, its ``trained`` record and, for an
    adapter, the ``AdapterSet`` on the model (``remove()`` restores the base exactly)."""

    path: Path
    step: int
    trained: dict[str, Any]
    config: AdapterConfig
    adapters: AdapterSet | None  # None: a full finetune, its weights are now the model's

    @property
    def full(self) -> bool:
        return self.config.full


def trained_config(trained: Any, where: str | os.PathLike = "checkpoint") -> AdapterConfig:
    """The ``AdapterConfig`` a checkpoint's recorded ``trained`` dict describes; its ``full``
    says whether the checkpoint holds a full finetune (decided there only)."""
    if not isinstance(trained, Mapping) or "algo" not in trained:
        raise TrainedError(f"{where}: state.json records no 'trained' algorithm ({trained!r}); "
                           f"it was not written by kmoss train")
    fields = dict(trained)
    fields["targets"] = list(fields.get("targets") or ())
    try:  # every knob checked as params.yaml's adapter section is: a damaged record is refused
        return build(AdapterConfig, fields, f"{where}: state.json trained")
    except ConfigError as e:
        raise TrainedError(f"{e} (the checkpoint's record of what it trained; export it with "
                           f"the version that trained it, or check the file)") from None


def load_trained(model: nn.Module, checkpoint: str | os.PathLike, ema: bool = False, *,
                 seed: int = 0, multiplier: float = 1.0) -> Trained:
    """Apply the training checkpoint folder ``checkpoint`` to ``model`` (its base): full
    weights loaded into it, or the adapter built on it (``seed`` for its initialisation,
    which the loaded state replaces) in eval mode at ``multiplier``; ``ema``: the EMA
    averages instead of the last weights."""
    ckpt = open_checkpoint(checkpoint, legacy_weights=True)  # verified reads, never a pickle
    trained = dict(ckpt.state.get("trained") or {})
    cfg = trained_config(ckpt.state.get("trained"), ckpt.path)
    weights = ckpt.ema() if ema else ckpt.trainable()
    if weights is None:
        raise TrainedError(f"{ckpt.path} holds no EMA weights (train with optim.ema > 0, or "
                           f"leave out ema)")
    if cfg.full:
        if any(p.is_meta for p in model.parameters()):
            raise TrainedError(f"{ckpt.path} holds a full finetune: it loads into a base's "
                               f"weights, not its shapes")
        model.load_state_dict(weights)
        return Trained(ckpt.path, ckpt.step, trained, cfg, None)
    if ema:  # the averages cover the trained parameters; the frozen rest is in trainable
        weights = {**ckpt.trainable(), **weights}
    shapes = any(p.is_meta for p in model.parameters())  # a base of shapes only (an export's)
    adapters = apply_adapters(model, cfg, seed=seed, device="cpu" if shapes else None)
    adapters.load_state_dict(weights)
    adapters.eval()
    adapters.set_multiplier(multiplier)
    return Trained(ckpt.path, ckpt.step, trained, cfg, adapters)
