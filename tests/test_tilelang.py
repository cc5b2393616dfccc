"""The ``tilelang`` backend (``kohakumoss/experimental/tilelang/ops.py``): every kernel against its
reference, forward and every gradient, over shapes and dtypes (``gpu``: TileLang kernels run on
CUDA only), at the real model's sizes, and in the tiny model; on the CPU, every kernel lowers
to CUDA for the archs it serves (TileLang's own semantic and layout checks), and the registry
offers it where it should: first on sm70 / sm75, where Triton does not run; on sm80+ only when
``kernels.backends`` names it.
"""

from __future__ import annotations

import pytest
import torch

from kohakumoss.kernels import KERNELS, backends, build_op_table
from kohakumoss.model import ops
from test_kernel_backends import (ATTENTION_SHAPES, ATTENTION_TOL, BASE, DEVICE, DTYPES, LENGTHS,
                                  REAL_LENGTHS, TOL, _attention_inputs, _ids, _real_call,
                                  _tiny_inputs, check_gated_residual, compare, leaf, parity_error,
                                  rel, seg_of)

OPS = ("rms_norm", "modulated_rms_norm", "situ", "gated_residual", "varlen_attention")
MODULE = backends.triton_module("experimental.tilelang.ops")


def needs_tilelang(dtype=torch.float32, attention=False):
    if MODULE is None:
        pytest.skip(f"tilelang cannot be imported here ({backends.unavailable_reason('experimental.tilelang.ops')})")
    if not MODULE.can_run(DEVICE, dtype, attention):
        pytest.skip(f"tilelang does not run {dtype} on {DEVICE}")


def tl(op: str):
    return KERNELS.backend(op, "tilelang").fn


# ---- CPU: the kernels lower, and the registry offers them where it should -------------------

LOWERED = [("norm_forward", (64, "float16", "float16", "float32", True)),
           ("norm_forward", (3072, "bfloat16", "bfloat16", "bfloat16", False)),
           ("norm_backward", (3072, "float32", "float32", "float32", True)),
           ("situ_forward", (8192, "float16")), ("situ_backward", (8192, "bfloat16")),
           ("gated_residual_forward", (3072, "float16", "float32")),
           ("gated_gradient", (3072, "bfloat16", "float32"))]


@pytest.mark.parametrize("arch", ["sm_75", "sm_90"])
def test_every_pointwise_kernel_lowers_to_cuda(arch):
    if MODULE is None:
        pytest.skip(f"tilelang cannot be imported here ({backends.unavailable_reason('experimental.tilelang.ops')})")
    import tilelang
    from tilelang import tvm

    from kohakumoss.experimental.tilelang import kernels as K

    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    for name, static in LOWERED:
        if arch == "sm_75" and "bfloat16" in static:
            continue
        with target:
            source = tilelang.lower(getattr(K, name)(*static), target=target).kernel_source
        assert "__global__" in source, name


@pytest.mark.parametrize("arch,dtype,passes,code", [("sm_75", "float16", ("backward",), "mma_sync"),
                                                    ("sm_86", "bfloat16", ("backward",), "cp_async")])
def test_attention_lowers_for_the_cards_without_a_gpu_test_here(arch, dtype, passes, code):
    """Turing (no flash attention of torch's there; 64 KiB of shared memory: smaller tiles):
    fp16 on ``mma.sync``; Ampere / Ada: ``cp.async`` copies, one stage
    (``pipeline_stages``). Both with the tiles ``attention_tiles`` picks for a head dim of
    128. The backward, the larger kernel with the tighter tiles, stands for both passes: each
    lowering takes 25-30 s of the CI's budget (sm90 runs both in the ``gpu`` tests; that the
    forward's tiles fit Turing's shared memory is ``test_attention_tiles_fit_each_card``)."""
    if MODULE is None:
        pytest.skip(f"tilelang cannot be imported here ({backends.unavailable_reason('experimental.tilelang.ops')})")
    import tilelang
    from tilelang import tvm

    from kohakumoss.experimental.tilelang import kernels as K

    tiles = dict(zip(("forward", "backward"), MODULE.attention_tiles((int(arch[3]), int(arch[4])), 128)))
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    for name in passes:
        kernel = getattr(K, f"attention_{name}")(24, 128, dtype, *tiles[name])
        with target:
            source = tilelang.lower(kernel, target=target).kernel_source
        assert "__global__" in source and code in source, name


def test_attention_tiles_fit_each_card():
    if MODULE is None:
        pytest.skip(f"tilelang cannot be imported here ({backends.unavailable_reason('experimental.tilelang.ops')})")
    assert MODULE.attention_tiles((9, 0), 128) == ((128, 128, 2, 256), (64, 64, 2, 256))
    assert MODULE.attention_tiles((8, 6), 128) == ((128, 128, 1, 256), (64, 64, 1, 256))
    fwd, bwd = MODULE.attention_tiles((7, 5), 128)  # Turing: 64 KiB
    assert 2 * 128 * (fwd[0] + 2 * fwd[2] * fwd[1]) <= 64 * 1024
    assert bwd[0] < 64 and MODULE.attention_tiles((9, 0), 32)[1][3] == 128  # 4 warps below Dh 64


def test_tilelang_is_first_on_turing_and_opt_in_on_ampere_and_newer(monkeypatch):
    if MODULE is None:
        pytest.skip(f"tilelang cannot be imported here ({backends.unavailable_reason('experimental.tilelang.ops')})")
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    situ, triton = KERNELS.backend("situ", "tilelang"), KERNELS.backend("situ", "triton")
    attention = KERNELS.backend("varlen_attention", "tilelang")
    for op in OPS:
        assert "tilelang" in KERNELS.names(op)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert situ.available(cuda, torch.float16) and not situ.opt_in(cuda)
    assert not situ.available(cuda, torch.bfloat16)  # no bf16 before sm80
    if backends.triton_module("kernels.triton_common") is not None:
        assert not triton.available(cuda, torch.float16)
    assert attention.available(cuda, torch.float16) and not attention.available(cuda, torch.float32)
    assert attention.takes({"Dh": 128}) and not attention.takes({"Dh": 48})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert situ.available(cuda, torch.bfloat16) and situ.opt_in(cuda)
    assert not situ.available(torch.device("cpu"), torch.float32)


def test_the_tuner_times_an_opt_in_backend_only_when_named():
    from kohakumoss.kernels.registry import KernelRegistry

    registry = KernelRegistry()
    anywhere = lambda device, dtype: True  # noqa: E731
    registry.register("situ", "fast", ops.situ, anywhere)
    registry.register("situ", "slow_build", ops.situ, anywhere, opt_in=lambda d: d.type == "cpu")
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert [b.name for b in registry.eligible("situ", cpu, torch.float32)] == ["fast"]
    assert [b.name for b in registry.eligible("situ", meta, torch.float32)] == ["fast", "slow_build"]
    named = registry.eligible("situ", cpu, torch.float32, allow=["slow_build"])
    assert [b.name for b in named] == ["slow_build"]


# ---- GPU: against the references -----------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_norms(lengths, dtype):
    needs_tilelang(dtype)
    g = torch.Generator().manual_seed(0)
    N, D, B = sum(lengths), 48, len(lengths)
    for shape in [(N, 48), (2, N, 64)]:
        x, w = leaf(g, *shape, dtype=dtype), leaf(g, shape[-1], dtype=dtype, scale=0.2)
        w.data += 1
        compare(tl("rms_norm"), ops.rms_norm, (x, w, 1e-6), {"x": x, "weight": w}, TOL[dtype])
    for shuffle in (False, True):
        x, w = leaf(g, N, D, dtype=dtype), leaf(g, D, dtype=dtype, scale=0.2)
        shift, scale = leaf(g, B, D, scale=0.5), leaf(g, B, D, scale=0.5)
        seg = seg_of(lengths, shuffle, g)
        compare(tl("modulated_rms_norm"), ops.modulated_rms_norm, (x, w, shift, scale, seg, 1e-6),
                {"x": x, "weight": w, "shift": shift, "scale": scale}, TOL[dtype])
    x = leaf(g, N, D, dtype=dtype)  # an adapter run: the norm's parameters frozen
    w, shift, scale = (leaf(g, *s, dtype=dtype, grad=False) for s in ((D,), (B, D), (B, D)))
    compare(tl("modulated_rms_norm"), ops.modulated_rms_norm,
            (x, w, shift, scale, seg_of(lengths), 1e-6), {"x": x}, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("shape", [(1, 40), (37, 64)], ids=str)
def test_situ(shape, dtype):
    needs_tilelang(dtype)
    g = torch.Generator().manual_seed(6)
    N, F = shape
    ug = leaf(g, N, 2 * F, dtype=dtype, scale=20.0)
    with torch.no_grad():
        ug[:, ::3] *= 1e-3
    u, gate = ug.split(F, dim=-1)
    compare(tl("situ"), ops.situ, (u, gate), {"ug": ug}, TOL[dtype])
    compare(tl("situ"), ops.situ, (gate, u), {"ug": ug}, TOL[dtype])  # joined by a copy
    u, gate = leaf(g, N, F, dtype=dtype, scale=4.0), leaf(g, N, F, dtype=dtype, scale=4.0)
    compare(tl("situ"), ops.situ, (u, gate), {"u": u, "g": gate}, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_gated_residual(lengths, dtype):
    needs_tilelang(dtype)
    check_gated_residual(tl("gated_residual"), lengths, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_ids)
@pytest.mark.parametrize("case", [*ATTENTION_SHAPES.values(), ([1, 130, 257, 64], 3, 128)],
                         ids=[*ATTENTION_SHAPES.keys(), "tiles"])
def test_attention(case, dtype):
    needs_tilelang(dtype, attention=True)
    lengths, heads, head_dim = case
    if head_dim % 32:
        with pytest.raises(TypeError, match="multiple of 32"):
            tl("varlen_attention")(*_attention_inputs(lengths, heads, head_dim, dtype, grad=False),
                                   lengths)
        return
    q, k, v = _attention_inputs(lengths, heads, head_dim, dtype, grad=True)
    if max(lengths) > 1:
        compare(tl("varlen_attention"), ops.varlen_attention, (q, k, v, lengths),
                {"q": q, "k": k, "v": v}, ATTENTION_TOL[dtype])
        return
    # one key per segment: the output is v, dv is dO, and dq = dk = 0 up to rounding (each
    # side's rounding noise, so no relative error between them means anything)
    out = tl("varlen_attention")(q, k, v, lengths)
    assert rel(out, v) <= ATTENTION_TOL[dtype]
    grad_out = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, [q, k, v], grad_out)
    assert rel(dv, grad_out) <= ATTENTION_TOL[dtype]
    assert dq.float().norm() <= 1e-2 * dv.float().norm() and dk.float().norm() <= 1e-2 * dv.float().norm()


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["rms_norm", "modulated_rms_norm", "situ", "gated_residual"])
def test_pointwise_at_the_real_sizes(op):
    needs_tilelang(torch.bfloat16)
    args, leaves = _real_call(op, torch.bfloat16, torch.Generator().manual_seed(12))
    compare(tl(op), ops.REFERENCE[op], args, leaves, TOL[torch.bfloat16])


@pytest.mark.gpu
def test_attention_at_the_real_sizes():
    needs_tilelang(torch.bfloat16, attention=True)
    q, k, v = _attention_inputs(REAL_LENGTHS, BASE.heads, BASE.head_dim, torch.bfloat16, grad=True)
    compare(tl("varlen_attention"), ops.varlen_attention, (q, k, v, REAL_LENGTHS),
            {"q": q, "k": k, "v": v}, ATTENTION_TOL[torch.bfloat16])


@pytest.mark.gpu
def test_the_tiny_model_with_tilelang_kernels_matches_the_reference():
    """Forward output and every parameter's gradient (a full finetune: the norms' and the
    modulation's gradients too), bf16, with recomputation on as in training."""
    needs_tilelang(torch.bfloat16, attention=True)
    from kohakumoss.memory import apply_recompute
    from kohakumoss.model import cast_model
    from kohakumoss.model.build import tiny_transformer

    img, text, sigma, layout = _tiny_inputs(torch.bfloat16)
    layout = layout.to(DEVICE)
    results = []
    for choices in ({}, {op: "tilelang" for op in OPS}):
        model = cast_model(tiny_transformer(), torch.bfloat16).to(DEVICE)
        model.ops = build_op_table(DEVICE, torch.bfloat16, choices)
        apply_recompute(model)
        v = model(img, text, sigma, layout)
        v.float().square().mean().backward()
        results.append((v, {n: p.grad for n, p in model.named_parameters()}))
    (v_ref, g_ref), (v_tl, g_tl) = results
    assert rel(v_tl, v_ref) <= 2e-2
    for name in g_ref:
        assert rel(g_tl[name], g_ref[name]) <= 2e-2, name


@pytest.mark.gpu
def test_parity_vectors_hold_with_the_tilelang_table():
    """``kmoss check parity tests/data/vectors``' fp32 comparison with every TileLang op
    that takes fp32 (attention, bf16/fp16 only, falls back to the reference)."""
    needs_tilelang(torch.float32)
    from kohakumoss.checks.parity import TOL as PARITY_TOL

    assert parity_error({op: "tilelang" for op in OPS}) <= PARITY_TOL[torch.float32]
