"""Memory engines: recomputation and per-block checkpointing give plain autograd's outputs
and gradients bit for bit, save fewer activations, and touch only the model they are
applied to."""

from __future__ import annotations

import pytest
import torch

from kohakumoss.memory import (ELEMENTWISE, MODES, apply_block_checkpointing,
                               apply_checkpointing, apply_recompute, recomputed, repeated_blocks)
from kohakumoss.memory.rebuild import apply_rebuild
from kohakumoss.model.engines import Handle
from kohakumoss.model import FLAVORS, build_layout, cast_model
from kohakumoss.model import ops
from kohakumoss.model.build import tiny_transformer

DTYPES = [torch.float64, torch.float32, torch.bfloat16]


def _op_calls(dtype):
    """Each elementwise op on leaf inputs; ``x`` is also used outside the op and twice
    inside some (the grouping of its gradient's sum is what could differ)."""
    g = torch.Generator().manual_seed(0)
    N, H, Dh = 7, 2, 8
    D = H * Dh
    seg = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    leaf = lambda *shape, dt=dtype: torch.randn(*shape, generator=g, dtype=dt).requires_grad_()  # noqa: E731
    x, y, w = leaf(N, D), leaf(N, D), leaf(D)
    mod = [leaf(2, D, dt=torch.float32) for _ in range(3)]
    q, wq = leaf(N, H, Dh), leaf(Dh)
    cos, sin = torch.randn(N, Dh // 2, generator=g), torch.randn(N, Dh // 2, generator=g)
    calls = {
        "rms_norm": lambda f: f(x, w, 1e-6),
        "modulated_rms_norm": lambda f: f(x, w, mod[0], mod[1], seg, 1e-6),
        "qk_norm_rope": lambda f: f(q, wq, cos, sin, 1e-6),
        "situ": lambda f: f(x, x * 2),
        "residual": lambda f: f(x, y),
        "gated_residual": lambda f: f(x, y, mod[2], seg),
    }
    return calls, [x, y, w, *mod, q, wq]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_a_recomputed_op_equals_plain_autograd(name, dtype):
    calls, leaves = _op_calls(dtype)
    fn = ops.REFERENCE[name]
    results = []
    for f in (fn, recomputed(fn, ELEMENTWISE[name])):
        out = calls[name](f)
        x = leaves[0]
        loss = out.float().square().sum() + (x.float() * 3).sum()  # x also feeds the loss
        results.append((out, torch.autograd.grad(loss, leaves, allow_unused=True)))
    (out_a, grads_a), (out_b, grads_b) = results
    assert torch.equal(out_a, out_b)
    for ga, gb in zip(grads_a, grads_b):
        assert (ga is None and gb is None) or torch.equal(ga, gb)


def _tiny(dtype, engines=()):
    model = cast_model(tiny_transformer(), dtype)
    for engine in engines:
        engine(model)
    return model


def _forward_backward(model, saved: list | None = None):
    hw, lens = [(3, 4), (2, 5)], [4, 6]
    g = torch.Generator().manual_seed(0)
    layout = build_layout(hw, lens)
    c = FLAVORS["tiny"]
    img = torch.randn(layout.n_img, c.latent_channels, generator=g)
    txt = torch.randn(layout.n_txt, c.text_dim, generator=g)
    sigma = torch.rand(2, generator=g)

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    if saved is None:
        out = model(img, txt, sigma, layout)
    else:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(img, txt, sigma, layout)
    out.float().square().mean().backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


ENGINES = {
    "recompute": [apply_recompute],
    "checkpoint blocks": [apply_block_checkpointing],
    "checkpoint every 2nd block": [lambda m: apply_block_checkpointing(m, every=2)],
    "both": [apply_recompute, apply_block_checkpointing],
    "sub-block": [lambda m: apply_checkpointing(m, "sub-block")],
    "selective": [lambda m: apply_checkpointing(m, "selective")],
    "partial 1": [lambda m: apply_checkpointing(m, "partial", 1)],
    "recompute + sub-block": [apply_recompute, lambda m: apply_checkpointing(m, "sub-block")],
    "recompute + selective": [apply_recompute, lambda m: apply_checkpointing(m, "selective")],
    "rebuild": [lambda m: apply_rebuild(m)],
    "recompute + rebuild": [apply_recompute, lambda m: apply_rebuild(m)],
    "partial + rebuild": [apply_recompute, lambda m: apply_checkpointing(m, "partial", 1),
                          lambda m: apply_rebuild(m)],
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("engines", sorted(ENGINES))
def test_engines_keep_outputs_and_gradients_bit_identical(engines, dtype):
    plain_out, plain_grads = _forward_backward(_tiny(dtype))
    model = _tiny(dtype, ENGINES[engines])
    out, grads = _forward_backward(model)
    assert torch.equal(out, plain_out)
    assert grads.keys() == plain_grads.keys()
    assert all(torch.equal(grads[n], plain_grads[n]) for n in grads), \
        [n for n in grads if not torch.equal(grads[n], plain_grads[n])]
    assert list(model.state_dict()) == list(_tiny(dtype).state_dict())  # keys are a contract


@pytest.mark.parametrize("engines", ["recompute", "checkpoint blocks", "sub-block", "selective"])
def test_engines_save_fewer_activations(engines):
    plain, lean = [], []
    _forward_backward(_tiny(torch.bfloat16), plain)
    _forward_backward(_tiny(torch.bfloat16, ENGINES[engines]), lean)
    assert sum(lean) < 0.8 * sum(plain), (sum(lean), sum(plain))


def _saved_bytes(*engines) -> int:
    """Bytes autograd holds from the forward to the backward (a checkpointed part counts
    only what it keeps: its inputs, and for ``selective`` its matmul outputs)."""
    saved = []
    _forward_backward(_tiny(torch.float32, [apply_recompute, *engines]), saved)
    return sum(saved)


def test_the_checkpointing_modes_order_by_memory():
    """block < sub-block < none; partial in steps of one block between none and block."""
    c = FLAVORS["tiny"]
    mode = lambda name, k=0: (lambda m: apply_checkpointing(m, name, k))  # noqa: E731
    none, block, sub = _saved_bytes(), _saved_bytes(mode("block")), _saved_bytes(mode("sub-block"))
    assert block < sub < 0.5 * none, (block, sub, none)
    partial = [_saved_bytes(mode("partial", k)) for k in range(1, c.depth + 1)]
    assert none > partial[0] and all(a > b for a, b in zip(partial, partial[1:])), partial
    assert partial[-1] == block


def _backward_ops(*engines, lora: bool = False) -> dict:
    """What the backward runs (recomputation included): ``mm``, how many matmuls;
    ``shapes``, each one's (contraction, output width); ``other``, how many other aten ops.
    ``lora``: with a rank-4 LoRA on the tiny model."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kohakumoss.adapters import apply_adapters
    from kohakumoss.config import AdapterConfig

    counts = {"mm": 0, "other": 0, "shapes": []}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if name in ("mm", "addmm"):
                a, b = (args[0], args[1]) if name == "mm" else (args[1], args[2])
                counts["mm"] += 1
                counts["shapes"].append((a.shape[-1], b.shape[-1]))
            else:
                counts["other"] += 1
            return func(*args, **(kwargs or {}))

    model = _tiny(torch.float32, [apply_recompute, *engines])
    if lora:
        apply_adapters(model, AdapterConfig(algo="lora", dim=4, alpha=4.0), seed=0)
    hw, lens = [(3, 4), (2, 5)], [4, 6]
    c = FLAVORS["tiny"]
    layout = build_layout(hw, lens)
    g = torch.Generator().manual_seed(0)
    out = model(torch.randn(layout.n_img, c.latent_channels, generator=g),
                torch.randn(layout.n_txt, c.text_dim, generator=g), torch.rand(2, generator=g), layout)
    with Count():
        out.square().mean().backward()
    return counts


def test_selective_checkpointing_keeps_the_matmuls_and_recomputes_the_rest():
    """Backward under ``selective`` runs no matmul again (their outputs were kept) but
    recomputes the elementwise work; ``block`` reruns every matmul of the block."""
    plain = _backward_ops()
    block = _backward_ops(lambda m: apply_checkpointing(m, "block"))
    selective = _backward_ops(lambda m: apply_checkpointing(m, "selective"))
    assert selective["mm"] == plain["mm"] < block["mm"], (plain, selective, block)
    assert selective["other"] > plain["other"], (plain, selective)


def test_selective_recomputes_a_lora_fold_from_the_kept_base_output():
    """A LoRA's delta is added into its base output by a narrow matmul (rank r into the
    layer's width): selective keeps the base output and reruns that narrow product in
    backward, instead of keeping a second full-width output per adapted linear."""
    from kohakumoss.memory.checkpointing import NARROW

    plain = _backward_ops(lora=True)["shapes"]
    selective = _backward_ops(lambda m: apply_checkpointing(m, "selective"), lora=True)["shapes"]
    rerun = list(selective)
    for km in plain:
        rerun.remove(km)
    assert rerun and all(k * NARROW <= m for k, m in rerun), rerun  # only the folds' products


class _Keeping:
    """Stands in for a weight ring, registered after the rebuilder: the registry hands it
    every saved tensor that is not a recipe, so it sees what autograd keeps (each storage
    once)."""

    def __init__(self):
        self.storages = {}

    def pack(self, t):
        self.storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    def unpack(self, t):
        return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rebuild_keeps_no_elementwise_output_and_trains_the_same(dtype):
    """With ``rebuild`` the norms', RoPE's and SiTU's outputs are not kept (a third of what
    the tiny model keeps goes), backward runs those ops again, and the gradients are plain
    autograd's bit for bit (``test_engines_keep_outputs_and_gradients_bit_identical``)."""
    plain = {}

    def pack(t):
        plain[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    model = _tiny(dtype, [apply_recompute])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _forward_backward(model)
    model = _tiny(dtype, [apply_recompute])
    rebuilder = apply_rebuild(model)
    keeping = _Keeping()
    ring = model.engines.register(Handle("keeping", saved=(keeping.pack, keeping.unpack)))
    _, grads = _forward_backward(model)
    kept, before = sum(keeping.storages.values()), sum(plain.values())
    assert rebuilder.rebuilt_bytes > 0 and kept < 0.8 * before, (kept, before)
    assert not rebuilder.made  # nothing of the forward is held after it
    assert model.ops.names()["rms_norm"].startswith("rebuilt(")  # which kernel still shows
    model.engines.remove(ring)
    _, again = _forward_backward(model)  # no ring: the same
    assert all(torch.equal(grads[n], again[n]) for n in grads)


def test_rebuild_refuses_an_input_changed_in_place():
    """A recipe reruns the op on its inputs: one modified in place since is an error naming
    the knob, never a silently different gradient."""
    model = _tiny(torch.float32, [apply_recompute])
    apply_rebuild(model)
    norm = model.ops.rms_norm
    w = torch.ones(8, requires_grad=True)
    x = torch.randn(3, 8, requires_grad=True)
    rebuilder = model.engines.state("rebuild")
    with torch.enable_grad():
        with model.engines.around_forward(grad=True):
            y = norm(x.clone(), w, 1e-6)
            z = (y * w).sum()  # mul keeps y for the gradient of w: a recipe
            args = rebuilder.made[y.untyped_storage()._cdata][3]
    with torch.no_grad():
        args[0].add_(1.0)
    with pytest.raises(RuntimeError, match="memory.rebuild"):
        z.backward()


def test_apply_checkpointing_names_what_it_wrapped_and_refuses_bad_modes():
    c = FLAVORS["tiny"]
    model = _tiny(torch.float32)
    paths = [p for p, _ in repeated_blocks(model)]
    assert apply_checkpointing(model, "sub-block") == [f"{p}.{h}" for p in paths for h in ("attention", "mlp")]
    assert apply_checkpointing(model, "sub-block") == []
    model = _tiny(torch.float32)
    assert apply_checkpointing(model, "partial", 1) == ["text_embedder.blocks.0", "layers.0"]
    assert apply_checkpointing(model, "none") == []
    assert len(apply_checkpointing(_tiny(torch.float32), "selective")) == c.text_blocks + c.depth
    assert set(MODES) == {"none", "block", "sub-block", "selective", "partial"}
    with pytest.raises(ValueError, match="one of none, block, sub-block, selective, partial"):
        apply_checkpointing(model, "blocks")
    with pytest.raises(ValueError, match="partial checkpointing needs blocks >= 1"):
        apply_checkpointing(model, "partial", 0)


def test_recompute_acts_on_that_models_table_only_and_once():
    a, b = _tiny(torch.float32), _tiny(torch.float32)
    assert apply_recompute(a) == list(ELEMENTWISE)
    assert apply_recompute(a) == []  # idempotent
    for name in ELEMENTWISE:
        assert getattr(a.ops, name).wraps.fn is ops.REFERENCE[name]
        assert getattr(b.ops, name).fn is ops.REFERENCE[name]
    x = torch.randn(3, 8)
    with torch.no_grad():  # inference runs the op itself
        assert torch.equal(a.ops.rms_norm(x, torch.ones(8), 1e-6), ops.rms_norm(x, torch.ones(8), 1e-6))


def test_recompute_leaves_kernels_that_keep_only_their_inputs_alone():
    """A kernel whose autograd keeps only its inputs is not wrapped (a second forward would
    buy nothing); a per-call answer (a tuned op) runs those calls directly and recomputes
    the others."""
    model = _tiny(torch.float32)
    lean = ops.OpEntry(lambda x, w, eps: ops.rms_norm(x, w, eps), "lean", keeps=True)
    model.ops.override("rms_norm", lean)
    done = apply_recompute(model)
    assert "rms_norm" not in done and model.ops.rms_norm is lean
    assert sorted(done) == sorted(set(ELEMENTWISE) - {"rms_norm"})

    calls = []

    def per_call(x, y):
        calls.append(x.shape[0])
        return ops.residual(x, y)

    wrapped = recomputed(ops.OpEntry(per_call, "per_call", keeps=lambda x, y: x.shape[0] > 4), 2)
    for n, recomputes in ((8, False), (3, True)):
        calls.clear()
        x, y = torch.randn(n, 4, requires_grad=True), torch.randn(n, 4, requires_grad=True)
        wrapped(x, y).sum().backward()
        assert len(calls) == (2 if recomputes else 1), (n, calls)  # forward, and again in backward
        assert torch.equal(x.grad, torch.ones(n, 4))


def test_block_checkpointing_finds_the_declared_blocks():
    model = _tiny(torch.float32)
    c = FLAVORS["tiny"]
    paths = [p for p, _ in repeated_blocks(model)]
    assert paths == ([f"text_embedder.blocks.{i}" for i in range(c.text_blocks)]
                     + [f"layers.{i}" for i in range(c.depth)])
    assert apply_block_checkpointing(model, every=2) == [p for p in paths if int(p[-1]) % 2 == 0]
    assert apply_block_checkpointing(model) == [p for p in paths if int(p[-1]) % 2 == 1]
    assert apply_block_checkpointing(model) == []
    with pytest.raises(ValueError, match="every must be an integer >= 1"):
        apply_block_checkpointing(model, every=0)


def test_block_checkpointing_replays_adapter_dropout():
    from kohakumoss.adapters import apply_adapters
    from kohakumoss.config import AdapterConfig

    def run(checkpoint: bool):
        model = _tiny(torch.float32)
        if checkpoint:
            apply_block_checkpointing(model)
        adapters = apply_adapters(model, AdapterConfig(algo="lora", dim=4, alpha=4, dropout=0.5),
                                  seed=0)
        adapters.prepare_step(0, 0)
        torch.manual_seed(3)
        out, _ = _forward_backward(model)
        return out, [p.grad for _, p in adapters.named_trainable()]

    (out_a, grads_a), (out_b, grads_b) = run(False), run(True)
    assert torch.equal(out_a, out_b)
    assert all(ga is not None and torch.equal(ga, gb) for ga, gb in zip(grads_a, grads_b))
