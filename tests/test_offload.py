"""Activation offload: block checkpointing whose kept inputs wait in host memory gives plain
autograd's outputs and gradients bit for bit (adapter dropout replayed, under weight
streaming too), trains adapters inside blocks whose input needs no gradient, and keeps
each block's input on the host."""

from __future__ import annotations

import pytest
import torch

from kohakumoss.memory import apply_checkpointing, repeated_blocks
from kohakumoss.memory.offload import apply_activation_offload
from kohakumoss.memory.replay import is_attention_kernel
from kohakumoss.model import ops
from kohakumoss.model import FLAVORS, MOSSImageTransformer, build_layout
from torch.utils._python_dispatch import TorchDispatchMode

from test_streaming import _model as _streamed_model
from test_streaming import _same, _step


def _model(dtype=torch.float32, offload=False, stream=0, halves=False, **adapter):
    model, aset, _ = _streamed_model(dtype, stream=stream, offload=offload and (
        "sub-block" if halves else "block"), **adapter)
    return model, aset, model.engines.state("activation offload")


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


def _forward(model):
    """The model's output on a fixed batch of two samples (3 x 4 and 2 x 5 cells, 4 and 6
    text tokens)."""
    g = torch.Generator().manual_seed(1)
    c = FLAVORS["tiny"]
    layout = build_layout([(3, 4), (2, 5)], [4, 6])
    return model(torch.randn(layout.n_img, c.latent_channels, generator=g),
                 torch.randn(layout.n_txt, c.text_dim, generator=g), torch.rand(2, generator=g), layout)


class _Kernels(TorchDispatchMode):
    """Counts the attention kernels' forwards that run."""

    def __init__(self):
        super().__init__()
        self.attention = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.attention += is_attention_kernel(func)
        return func(*args, **(kwargs or {}))


def _tails_seen(model):
    """Per call of each part's tail: (in a joint block, left uncomputed, its output's largest
    magnitude)."""
    seen = []
    for name, block in repeated_blocks(model):
        for path in block.TAILS.values():
            tail = block.get_submodule(path)
            tail.register_forward_hook(lambda m, a, out, joint=name.startswith("layers."): seen.append(
                (joint, bool(getattr(m, "kmoss_unevaluated", False)), out.abs().max().item())))
    return seen


@pytest.mark.parametrize("preset", ["attn-mlp", "attn", "all"])
@pytest.mark.parametrize("halves", [False, True], ids=["block", "sub-block"])
def test_recomputation_replays_attention_and_leaves_tails_out(preset, halves):
    """Backward runs no attention kernel (forward's outputs come back with the input), and a
    tail whose gate is frozen is left uncomputed (a LoRA on it, or a plain frozen linear
    with ``attn``), with gradients bit-identical to plain autograd's; with the modulation
    trained (``all``) the joint blocks' tails are computed (their gate's gradient reads them)."""
    plain = _model(preset=preset)
    model, aset, off = _model(offload=True, halves=halves, preset=preset)
    for _ in range(2):  # the second step finds the text refiner untrained (its input's too)
        _same(_step(model, aset), _step(*plain[:2]))
    seen = _tails_seen(model)
    c = FLAVORS["tiny"]
    out = _forward(model)
    forward_calls = len(seen)
    assert forward_calls and not any(skipped for _, skipped, _ in seen)
    with _Kernels() as counted:
        out.float().square().mean().backward()
    assert counted.attention == 0
    recomputed = seen[forward_calls:]
    parts = 2 if halves else 1
    joint = [m for j, s, m in recomputed if j and s]
    text = [m for j, s, m in recomputed if not j and s]
    if preset == "all":  # the modulation trains: the joint gates need their tails' outputs
        assert not joint and len(text) == c.text_blocks * parts
    else:
        assert len(joint) == c.depth * parts
    assert all(m == 0 for m in joint + text)
    assert off.bytes > 0


def test_recomputation_of_a_plain_checkpoint_runs_attention_again():
    """The counter sees the kernels: block checkpointing without offload runs attention in
    backward again, once per segment of every block."""
    model, aset, _ = _streamed_model(mode="block", preset="attn-mlp")
    c = FLAVORS["tiny"]
    out = _forward(model)
    with _Kernels() as counted:
        out.float().square().mean().backward()
    assert counted.attention == c.depth * 2


@pytest.mark.gpu
@pytest.mark.parametrize("offload", ["block", "sub-block"])
def test_offload_on_cuda_replays_the_fused_attention(offload):
    """On the GPU the fused attention kernels (cuDNN or flash) run once per step, in forward,
    and the tails of the joint blocks are left uncomputed; gradients within bf16 round-off
    of the resident run (the fused backwards sum with atomics: not bit for bit)."""
    import dataclasses

    from test_streaming import _cuda_run

    c = dataclasses.replace(FLAVORS["tiny"], dim=1024, heads=8, ffn_dim=4096, depth=6, text_blocks=2)
    plain = _cuda_run(c, 0, False, preset="attn-mlp")
    with _Kernels() as counted:
        kept = _cuda_run(c, 0, offload, preset="attn-mlp")
    # forward only: two steps, two segments per joint block (the text refiner's too)
    assert counted.attention == 2 * 2 * (c.depth + c.text_blocks)
    for (out_a, grads_a), (out_b, grads_b) in zip(plain, kept):
        # (under the counting mode the LoRA accumulates out of place: the same sums)
        torch.testing.assert_close(out_a, out_b, rtol=1e-2, atol=1e-2)
        for n in grads_a:
            err = (grads_a[n].float() - grads_b[n].float()).norm() / grads_a[n].float().norm()
            assert err < 2e-2, (n, err.item())


def test_forward_keeps_no_graph_of_the_recorded_attention_under_an_outer_pack_hook():
    """Forward runs attention with grad to record what backward needs, then drops that
    graph. Under an outer pack hook that returns the tensor (weight streaming's) the saved
    output and its node would hold each other: nothing may stay alive after the forward."""
    import gc
    import weakref

    model, aset, _ = _model(offload=True, preset="attn-mlp")
    g = torch.Generator().manual_seed(1)
    c = FLAVORS["tiny"]
    layout = build_layout([(3, 4), (2, 5)], [4, 6])
    made = []  # the inputs the recording runs the attention on: its graph saves them
    inner = model.ops.varlen_attention.fn.attention

    def spy(q, k, v, lengths):
        made.extend(weakref.ref(t) for t in (q, k, v))
        return inner(q, k, v, lengths)

    model.ops.varlen_attention.fn.attention = ops.OpEntry.of(spy)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        model(torch.randn(layout.n_img, c.latent_channels, generator=g),
              torch.randn(layout.n_txt, c.text_dim, generator=g), torch.rand(2, generator=g), layout)
    gc.collect()
    assert made and all(r() is None for r in made)


def test_a_backend_the_mode_cannot_see_is_recomputed_as_before():
    """Flex attention is compiled: the dispatch mode would not see its kernel as one op.
    An op table entry that says it runs flex is left alone: nothing recorded, backward runs
    the attention again, the gradients are still plain autograd's."""
    plain = _model(preset="attn-mlp")
    model, aset, off = _model(offload=True, preset="attn-mlp")
    reference = model.ops.varlen_attention.fn.attention

    class Flexish:
        def backend_for(self, *args):
            return "flex"

        def __call__(self, *args):
            return reference(*args)

    model.ops.varlen_attention.fn.attention = ops.OpEntry(Flexish(), "flexish", chooser=Flexish().backend_for)
    for _ in range(2):
        _same(_step(model, aset), _step(*plain[:2]))
    c = FLAVORS["tiny"]
    out = _forward(model)
    assert off.kept and all(not entry.added for entry in off.kept)  # nothing beside the inputs
    with _Kernels() as counted:
        out.float().square().mean().backward()
    assert counted.attention == c.depth * 2


# ---- an attention backend of custom ops (FA4's, TileLang's form), on the CPU ----------------

_SEEN_CALLS = {"forward": 0}


def _seen_fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    _SEEN_CALLS["forward"] += 1
    from kohakumoss.model import ops
    return ops.varlen_attention(q, k, v, lengths), q.new_zeros(q.shape[:2], dtype=torch.float32)


def _seen_bwd_impl(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax attention's gradients per segment, written out (a custom op's body runs
    below autograd: no autograd.grad in it)."""
    scale = q.shape[-1] ** -0.5
    grads = [[], [], []]
    for dos, qs, ks, vs in zip(*(t.split(lengths) for t in (do, q, k, v))):
        qs, ks, vs, dos = (t.transpose(0, 1) for t in (qs, ks, vs, dos))  # [H, n, Dh]
        p = torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1)
        dp = dos @ vs.transpose(1, 2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        for acc, t in zip(grads, (ds @ ks * scale, ds.transpose(1, 2) @ qs * scale,
                                  p.transpose(1, 2) @ dos)):
            acc.append(t.transpose(0, 1))
    return tuple(torch.cat(acc) for acc in grads)


def _seen_attention():
    """Attention as ``custom.entry`` enters a kernel: a custom op (named as an attention
    kernel) and a plain autograd Function in eager mode; the forward is the reference's, the
    log-sum-exp a kernel returns beside its output a placeholder."""
    from kohakumoss.kernels.custom import entry

    # named as FA4's op: selective checkpointing keeps its outputs by that name
    fwd = torch.library.custom_op("kmoss_test::fa4_attention", _seen_fwd_impl, mutates_args=())
    fwd.register_fake(lambda q, k, v, lengths: (torch.empty_like(q),
                                                q.new_empty(q.shape[:2], dtype=torch.float32)))
    bwd = torch.library.custom_op("kmoss_test::fa4_attention_bwd", _seen_bwd_impl, mutates_args=())
    bwd.register_fake(lambda do, q, k, v, lengths: (torch.empty_like(q), torch.empty_like(k),
                                                    torch.empty_like(v)))

    def setup(ctx, inputs, output):
        q, k, v, lengths = inputs
        ctx.save_for_backward(q, k, v)
        ctx.lengths = lengths
        ctx.mark_non_differentiable(output[1])

    def backward(ctx, do, _dlse):
        return (*ctx.bwd(do, *ctx.saved_tensors, ctx.lengths), None)

    call = entry(fwd, _seen_fwd_impl, setup, backward, bwd, _seen_bwd_impl)
    return lambda q, k, v, lengths: call(q, k, v, [int(n) for n in lengths])[0]


SEEN = _seen_attention()


@pytest.mark.parametrize("halves", [False, True], ids=["block", "sub-block"])
def test_an_attention_backend_of_custom_ops_is_replayed(halves):
    """A kernel entered as FA4's and TileLang's are (``custom.entry``) is one op to the
    recording mode: backward runs no attention forward again, and the gradients are plain
    autograd's bit for bit."""
    plain = _model(preset="attn-mlp")
    model, aset, _ = _model(offload=True, preset="attn-mlp", halves=halves)
    model.ops.varlen_attention.fn.attention = ops.OpEntry.of(SEEN)
    plain[0].ops.override("varlen_attention", SEEN)
    for _ in range(2):
        _same(_step(model, aset), _step(*plain[:2]))
    c = FLAVORS["tiny"]
    out = _forward(model)
    forward = _SEEN_CALLS["forward"]
    assert forward >= c.depth
    with _Kernels() as counted:
        out.float().square().mean().backward()
    assert _SEEN_CALLS["forward"] == forward and counted.attention == 0


def test_selective_checkpointing_keeps_an_attention_custom_op_s_output():
    """``selective`` keeps the outputs of FA4's and TileLang's attention ops, as it keeps
    cuDNN's: backward runs no attention forward again; gradients are plain autograd's."""
    plain = _streamed_model(preset="attn-mlp")
    model, aset, _ = _streamed_model(mode="selective", preset="attn-mlp")
    for m in (plain[0], model):
        m.ops.override("varlen_attention", SEEN)
    _same(_step(model, aset), _step(*plain[:2]))
    out = _forward(model)
    forward = _SEEN_CALLS["forward"]
    out.float().square().mean().backward()
    assert _SEEN_CALLS["forward"] == forward
