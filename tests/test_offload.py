"""Activation offload: block checkpointing whose kept inputs wait in host memory gives plain
autograd's outputs and gradients bit for bit (adapter dropout replayed, under weight
streaming too), trains adapters inside blocks whose input needs no gradient, and keeps
each block's input on the host."""

from __future__ import annotations

import pytest
import torch

from kohakumoss.memory import apply_checkpointing, repeated_blocks
from kohakumoss.memory.offload import apply_activation_offload
from kohakumoss.model import FLAVORS, MOSSImageTransformer

from test_streaming import _model as _streamed_model
from test_streaming import _same, _step


def _model(dtype=torch.float32, offload=False, stream=0, halves=False, **adapter):
    model, aset, _ = _streamed_model(dtype, stream=stream, offload=offload and (
        "sub-block" if halves else "block"), **adapter)
    return model, aset, getattr(model, "offloader", None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("stream", [0, 1, 2])
@pytest.mark.parametrize("halves", [False, True], ids=["block", "sub-block"])
def test_offload_keeps_outputs_and_gradients_bit_identical(dtype, stream, halves):
    plain = _model(dtype)
    model, aset, off = _model(dtype, offload=True, stream=stream, halves=halves)
    for _ in range(2):  # a second step reuses the offloader
        _same(_step(model, aset), _step(*plain[:2]))
    # every block's (or half's) input went to the host once per forward
    assert len(off.kept) == len(repeated_blocks(model)) * (2 if halves else 1)
    assert off.bytes > 0


@pytest.mark.parametrize("halves", [False, True], ids=["block", "sub-block"])
def test_offload_replays_adapter_dropout(halves):
    torch.manual_seed(5)
    plain = _model(dropout=0.3)
    model, aset, _ = _model(offload=True, dropout=0.3, halves=halves)
    torch.manual_seed(7)
    a = _step(*plain[:2])
    torch.manual_seed(7)
    b = _step(model, aset)
    _same(a, b)


def test_adapters_inside_a_block_whose_input_needs_no_gradient_still_train():
    """Only the text blocks carry an adapter: their input (the text projection, frozen)
    needs no gradient, yet backward must run them."""
    targets = (r"text_embedder\.blocks\.\d+\.qkv$",)
    plain = _model(targets=targets, preset="attn")
    model, aset, _ = _model(offload=True, targets=targets, preset="attn", halves=True)
    out, grads = _step(model, aset)
    assert grads and all(g.abs().sum() > 0 for g in grads.values())
    _same((out, grads), _step(*plain[:2]))


def test_offload_refuses_to_stack_on_another_checkpointing():
    for mode in ("block", "sub-block"):
        m = MOSSImageTransformer(FLAVORS["tiny"])
        apply_checkpointing(m, mode)
        with pytest.raises(ValueError, match="instead of another checkpointing"):
            apply_activation_offload(m, "cpu", halves=True)
    m = MOSSImageTransformer(FLAVORS["tiny"])
    apply_activation_offload(m, "cpu")
    with pytest.raises(ValueError, match="already"):
        apply_activation_offload(m, "cpu")
