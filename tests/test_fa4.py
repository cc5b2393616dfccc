"""The ``fa4`` backend of ``varlen_attention`` (FlashAttention-4's kernels, the optional
``flash-attn-4`` package; ``kohakumoss/kernels/attention/fa4.py``). Its forward and gradients
against the reference over the segment cases and at the real sizes are in
``test_kernel_backends.py``; here: where it is offered, what it says when it cannot run or
is not installed, and, on a card it runs on, the tiny model, ``torch.compile``, deterministic
gradients and activation offload's replay."""

from __future__ import annotations

import functools

import pytest
import torch

from kohakumoss.kernels import KERNELS, backends, build_op_table
from kohakumoss.kernels.attention import varlen as attention
from kohakumoss.model import ops

CUDA = torch.cuda.is_available()
FA4 = KERNELS.backend("varlen_attention", "fa4")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def needs_fa4(dtype=torch.bfloat16):
    if not (CUDA and FA4.available(torch.device("cuda"), dtype)):
        why = backends._why.get("kernels.attention.fa4", "no sm90-sm110 card here")
        pytest.skip(f"fa4 cannot run here ({why})")


def test_fa4_takes_the_head_dims_it_was_checked_at():
    assert [d for d in range(1, 300) if attention.fa4_fits({"Dh": d})] == [32, 64, 96, 128]


def test_fa4_is_imported_only_where_its_card_and_dtype_are(monkeypatch):
    """``flash_attn.cute`` takes seconds to import: the registry asks the card and dtype first."""
    asked = []
    monkeypatch.setattr(backends, "triton_module", lambda name: asked.append(name))
    assert not FA4.available(torch.device("cpu"), torch.bfloat16)
    if CUDA:
        assert not FA4.available(torch.device("cuda"), torch.float32)
    assert asked == []


def test_fa4_without_the_package_names_the_extra(monkeypatch):
    monkeypatch.setattr(backends, "triton_module", lambda name: None)
    monkeypatch.setitem(backends._why, "kernels.attention.fa4", "ModuleNotFoundError: No module named 'flash_attn'")
    q = torch.randn(4, 2, 16)
    with pytest.raises(RuntimeError, match=r"flash-attn-4 cannot be imported.*kohakumoss\[fa4\]"):
        FA4.fn(q, q, q, [3, 1])


def test_a_static_fa4_choice_falls_back_to_the_reference_where_it_cannot_run():
    table = build_op_table("cpu", torch.bfloat16, {"varlen_attention": "fa4"})
    assert table.varlen_attention.fn is ops.varlen_attention


# ---- on a card FA4 runs on -------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_tiny_model_with_fa4_attention_matches_the_reference(dtype):
    """Forward output and every parameter's gradient, the attention alone swapped."""
    needs_fa4(dtype)
    from test_kernel_backends import _tiny_inputs

    from kohakumoss.model import cast_model
    from kohakumoss.model.build import tiny_transformer

    device = torch.device("cuda")
    img, text, sigma, layout = _tiny_inputs(dtype)
    layout = layout.to(device)
    results = []
    for swap in (False, True):
        torch.manual_seed(0)
        model = cast_model(tiny_transformer(), dtype).to(device)
        model.ops = build_op_table(device, dtype, {})
        if swap:  # the backend itself, not a choice that could fall back to the reference
            model.ops.override("varlen_attention", FA4.fn)
        v = model(img, text, sigma, layout)
        v.float().square().mean().backward()
        results.append((v, {n: p.grad for n, p in model.named_parameters()}))
    (v_ref, g_ref), (v_fa4, g_fa4) = results
    assert rel(v_fa4, v_ref) <= 2e-2
    for name in g_ref:
        assert rel(g_fa4[name], g_ref[name]) <= 2e-2, name


def _inputs(lengths, dtype, seed=3, heads=24, head_dim=128):
    g = torch.Generator(device="cuda").manual_seed(seed)
    N = sum(lengths)
    return [torch.randn(N, heads, head_dim, device="cuda", dtype=dtype, generator=g)
            .requires_grad_() for _ in range(3)]


@pytest.mark.gpu
def test_fa4_under_torch_compile_matches_eager():
    """The custom ops' fake registrations let ``torch.compile`` trace through the backend."""
    needs_fa4()
    lengths = [300, 1, 517]
    q, k, v = _inputs(lengths, torch.bfloat16)
    do = torch.randn_like(q)

    def f(q, k, v):
        return FA4.fn(q, k, v, lengths) * 2.0

    eager = f(q, k, v)
    want = torch.autograd.grad(eager, (q, k, v), do)
    compiled = torch.compile(f, fullgraph=True)(q, k, v)
    got = torch.autograd.grad(compiled, (q, k, v), do)
    assert torch.equal(compiled, eager)
    for a, b in zip(got, want):  # dQ is summed by atomics: the order moves its last bits
        assert rel(a, b) <= 1e-4


@pytest.mark.gpu
def test_fa4_gradients_repeat_bit_for_bit_under_deterministic_algorithms():
    needs_fa4()
    lengths = [4200, 4198, 17]
    q, k, v = _inputs(lengths, torch.bfloat16, heads=4)
    do = torch.randn_like(q)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        runs = [torch.autograd.grad(FA4.fn(q, k, v, lengths), (q, k, v), do) for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(was)
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0]))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
def test_fa4_at_every_head_dim_it_takes(head_dim):
    """Short, lone and multi-tile segments; a lone token's dq and dk are zero in exact math,
    so its rows are compared by size, the rest by relative error."""
    needs_fa4()
    lengths = [5, 1, 9, 130, 257]
    q, k, v = _inputs(lengths, torch.bfloat16, heads=3, head_dim=head_dim)
    do = torch.randn_like(q)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = ops.varlen_attention(*ref, lengths)
    exp = torch.autograd.grad(want, ref, do.double())
    out = FA4.fn(q, k, v, lengths)
    got = torch.autograd.grad(out, (q, k, v), do)
    assert rel(out, want) <= 2e-2
    lone = torch.zeros(sum(lengths), dtype=torch.bool, device="cuda")
    lone[5] = True
    for name, a, b in zip("qkv", got, exp):
        assert rel(a[~lone], b[~lone]) <= 2e-2, name
    for a in got[:2]:
        assert a[lone].float().norm() <= 1e-2 * got[2][lone].float().norm()


@pytest.mark.gpu
@pytest.mark.parametrize("launch", [{"tile_mn": (128, 176)}, {"mma_pv_is_rs": False}], ids=str)
def test_a_forward_launch_of_the_bench_keeps_the_outputs(launch, monkeypatch):
    """``fa4_attention.FWD_LAUNCH`` (what ``bench/bench_fa4_configs.py --passes fwd`` picks)
    reaches the kernel and keeps the output within bf16's rounding of the package's choice."""
    needs_fa4()
    from kohakumoss.kernels.attention import fa4 as fa4_attention

    lengths = [4202, 4106, 9]
    q, k, v = _inputs(lengths, torch.bfloat16, heads=4)
    with torch.no_grad():
        want = FA4.fn(q, k, v, lengths)
        calls = []
        fwd = fa4_attention._fa4._flash_attn_fwd

        @functools.wraps(fwd)  # with its attributes: the package reads its own compile_cache
        def spy(*a, **kw):
            calls.append(kw)
            return fwd(*a, **kw)

        monkeypatch.setattr(fa4_attention._fa4, "_flash_attn_fwd", spy)
        monkeypatch.setattr(fa4_attention, "FWD_LAUNCH", launch)
        got = FA4.fn(q, k, v, lengths)
    assert calls and all(calls[0][name] == value for name, value in launch.items())
    assert rel(got, want) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("offload", ["block", "sub-block"])
def test_activation_offload_replays_fa4(offload):
    """Under activation offload FA4's forward runs once a step, in forward: its custom op is
    one op to the recording mode, which hands its outputs back to the recomputation.
    Gradients within bf16 round-off of the resident run (dQ is summed by atomics)."""
    needs_fa4()
    import dataclasses

    from test_offload import _Kernels
    from test_streaming import _cuda_run

    from kohakumoss.model import FLAVORS

    class _Named(_Kernels):
        def __init__(self):
            super().__init__()
            self.fa4 = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.fa4 += func._schema.name == "kohakumoss::fa4_attention"
            return super().__torch_dispatch__(func, types, args, kwargs)

    c = dataclasses.replace(FLAVORS["tiny"], dim=1024, heads=8, ffn_dim=4096, depth=6, text_blocks=2)
    plain = _cuda_run(c, 0, False, preset="attn-mlp", attention="fa4")
    with _Named() as counted:
        kept = _cuda_run(c, 0, offload, preset="attn-mlp", attention="fa4")
    # two steps, one launch per block for all its segments (the text refiner's blocks too)
    assert counted.fa4 == counted.attention == 2 * (c.depth + c.text_blocks)
    for (out_a, grads_a), (out_b, grads_b) in zip(plain, kept):
        torch.testing.assert_close(out_a, out_b, rtol=1e-2, atol=1e-2)
        for n in grads_a:
            assert rel(grads_b[n], grads_a[n]) < 2e-2, n


def test_tune_kernels_says_what_a_card_fa4_runs_on_lacks(monkeypatch):
    monkeypatch.setattr(attention, "fa4_card", lambda device: True)
    monkeypatch.setattr(backends, "triton_module", lambda name: None)
    monkeypatch.setitem(backends._why, "kernels.attention.fa4", "ModuleNotFoundError: No module named 'flash_attn'")
    hint, = backends.missing_kernels("cuda")
    assert "No module named 'flash_attn'" in hint and "pip install 'kohakumoss[fa4]'" in hint
    monkeypatch.setattr(attention, "fa4_card", lambda device: False)
    assert backends.missing_kernels("cuda") == []
