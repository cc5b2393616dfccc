"""Per-block activation checkpointing: a repeated block keeps only its inputs in forward
and runs again in backward (``torch.utils.checkpoint``, non-reentrant, RNG state preserved
so adapter dropout draws the same masks).

Applied from outside: ``apply_block_checkpointing(model)`` replaces the ``forward`` of the
blocks the model declares in ``REPEATED`` (``kohakumoss.model.dit``) on those block
instances. The modules, their parameters and the state-dict keys stay as they are, nothing
in the model's own forward changes, and adapters that wrap a linear inside a block are
recomputed with it. Outputs and gradients are exactly those of plain autograd.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kohakumoss.model.dit import REPEATED, MOSSImageTransformer


def repeated_blocks(model: MOSSImageTransformer) -> list[tuple[str, nn.Module]]:
    """``(path, block)`` of every repeated block, in ``REPEATED`` order."""
    return [(f"{path}.{i}", block) for path in REPEATED
            for i, block in enumerate(model.get_submodule(path))]


def checkpointed(forward: Callable) -> Callable:
    """``forward`` run under non-reentrant checkpointing while grad is enabled (without
    grad there is nothing to save and it runs as is); ``.checkpointed`` is ``forward``."""

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    run.checkpointed = forward
    return run


def apply_block_checkpointing(model: MOSSImageTransformer, every: int = 1) -> list[str]:
    """Checkpoint every ``every``-th block of each repeated list (1: all of them); returns
    the paths checkpointed now (a block checkpointed before is left as it is)."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be an integer >= 1 (1 checkpoints every block), got {every!r}")
    done = []
    for path, block in repeated_blocks(model):
        if int(path.rsplit(".", 1)[1]) % every or hasattr(block.forward, "checkpointed"):
            continue
        block.forward = checkpointed(block.forward)
        done.append(path)
    return done
