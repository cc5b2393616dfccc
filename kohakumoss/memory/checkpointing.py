"""Activation checkpointing: parts of the repeated blocks keep only their inputs in forward
and run again in backward (``torch.utils.checkpoint``, non-reentrant, RNG state preserved so
adapter dropout draws the same masks). Outputs and gradients are exactly those of plain
autograd, in every mode.

``apply_checkpointing(model, mode, blocks)``, on the blocks the model declares in
``REPEATED`` (and their halves, ``HALVES``; ``kohakumoss.model.dit``), by wrapping those
blocks' parts through the model's engine registry (``model/engines.py``): the modules, their parameters and the state-dict keys stay as they
are, nothing in the model's own forward changes, and adapters that wrap a linear inside a
block are recomputed with it. The modes (``MODES``), least memory first:

- ``block``: every block keeps only its input; backward runs the block again;
- ``sub-block``: the attention half and the MLP half each keep only their input (one more
  saved activation per block than ``block``; backward holds half a block's intermediates
  at a time, not a whole block's);
- ``selective``: every block runs under a policy that keeps the outputs of the matmuls and
  the attention (costly to recompute, ``SAVED_OPS``) and recomputes everything else (the
  norms, RoPE, SiTU, the residual adds: cheap to compute, yet most of the bytes), and the
  matmuls whose contraction is narrow beside their output (``NARROW``: a LoRA's up product,
  which adds its delta into the base output at a few percent of the base matmul's cost; kept,
  it doubled what selective keeps);
- ``partial``: ``block`` for the first ``blocks`` blocks of each repeated list (a list
  shorter than that entirely), the rest keep everything: memory traded for speed in steps
  of one block;
- ``none``: nothing is checkpointed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from kohakumoss.model.dit import HALVES, REPEATED, MOSSImageTransformer
from kohakumoss.model.engines import Handle

ENGINE = "checkpointing"

MODES = ("none", "block", "sub-block", "selective", "partial")
# ops whose outputs ``selective`` keeps: the matmuls and the attention kernels (torch's, and
# the custom ops of FA4's and TileLang's, which ``custom.entry`` calls as ops under the policy's
# dispatch mode)
SAVED_OPS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_flash_attention_forward", "_efficient_attention_forward", "_cudnn_attention_forward",
             "fa4_attention", "tilelang_attention")


def repeated_blocks(model: MOSSImageTransformer) -> list[tuple[str, nn.Module]]:
    """``(path, block)`` of every repeated block, in ``REPEATED`` order."""
    return [(f"{path}.{i}", block) for path in REPEATED
            for i, block in enumerate(model.get_submodule(path))]


# a matmul contracting k into m outputs with k * NARROW <= m is recomputed (rank r into D)
NARROW = 8


def _contraction(name: str, args: tuple) -> tuple[int, int] | None:
    """``(k, m)`` of a matmul's contraction and output width, None for another op."""
    a, b = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2)}.get(name, (None, None))
    if a is None or len(args) <= b:
        return None
    return args[a].shape[-1], args[b].shape[-1]


def _keeps_output(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    name = getattr(func, "__name__", str(func)).split(".")[0]
    if name not in SAVED_OPS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    km = _contraction(name, args)
    if km is not None and km[0] * NARROW <= km[1]:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def checkpointed(forward: Callable, selective: bool = False) -> Callable:
    """``forward`` run under non-reentrant checkpointing while grad is enabled (without
    grad there is nothing to save and it runs as is); ``selective``: keeping the matmuls'
    and the attention's outputs. ``.checkpointed`` is ``forward``."""
    context = functools.partial(create_selective_checkpoint_contexts, _keeps_output) if selective \
        else None

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if context is not None:
            return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    run.checkpointed = forward
    return run


def _handle(model: MOSSImageTransformer) -> Handle:
    """The checkpointing engine's handle on ``model`` (registered on first use)."""
    return model.engines.get(ENGINE) or model.engines.register(Handle(ENGINE))


def _wrap(model: MOSSImageTransformer, block: nn.Module, part: str, selective: bool = False) -> bool:
    if model.engines.wrapped_parts(block):  # checkpointed before (or offloaded): left as it is
        return False
    model.engines.wrap_part(_handle(model), block, part, lambda fn: checkpointed(fn, selective))
    return True


def apply_checkpointing(model: MOSSImageTransformer, mode: str, blocks: int = 0) -> list[str]:
    """Checkpoint ``model``'s repeated blocks in ``mode`` (see the module; ``blocks``: how
    many per list, for ``partial``). Returns what was wrapped now (``layers.3`` or
    ``layers.3.attention``); a block wrapped before is left as it is."""
    if mode not in MODES:
        raise ValueError(f"checkpointing mode {mode!r}: one of {', '.join(MODES)}")
    if mode == "partial" and (isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1):
        raise ValueError(f"partial checkpointing needs blocks >= 1 (how many blocks of each list "
                         f"to checkpoint), got {blocks!r}")
    done = []
    for path, block in repeated_blocks(model):
        if mode == "sub-block":
            if not model.engines.wrapped_parts(block):
                for half in HALVES:
                    model.engines.wrap_part(_handle(model), block, half, checkpointed)
                done += [f"{path}.{half}" for half in HALVES]
        elif mode in ("block", "selective") or (mode == "partial" and int(path.rsplit(".", 1)[1]) < blocks):
            if _wrap(model, block, "forward", selective=mode == "selective"):
                done.append(path)
    return done


def apply_block_checkpointing(model: MOSSImageTransformer, every: int = 1) -> list[str]:
    """Checkpoint every ``every``-th block of each repeated list (1: all of them); returns
    the paths checkpointed now (a block checkpointed before is left as it is)."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be an integer >= 1 (1 checkpoints every block), got {every!r}")
    done = []
    for path, block in repeated_blocks(model):
        if int(path.rsplit(".", 1)[1]) % every == 0 and _wrap(model, block, "forward"):
            done.append(path)
    return done
