"""The Triton GEMM behind ``ops.linear`` (``kohakumoss/kernels/triton_gemm.py``) against
fp32 matmuls: both layouts (``x W^T`` forward, ``dy W`` input gradient), accumulation onto
an output, ragged tiles; the op's gradients; the LoRA nodes built on it; a model whose table
takes it; the tuner's problems for it.

Where it runs: CUDA sm90+ compiled (bf16, fp16); on the CPU, Triton's interpreter in fp16
(``test_the_interpreted_gemm_suite`` reruns the ``triton_test`` tests with
``TRITON_INTERPRET=1``). The ``gpu`` tests take the real model's shapes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kohakumoss.kernels import KERNELS, backends, build_op_table
from kohakumoss.kernels.problems import PROBLEMS, plan_problems
from kohakumoss.model import FLAVORS, ops
from test_kernel_backends import COMMON, CUDA, DEVICE, INTERPRETED, rel, run_interpreted

GEMM_TESTS: list[str] = []
SM90 = CUDA and torch.cuda.get_device_capability() >= (9, 0)
DTYPES = [torch.bfloat16, torch.float16] if CUDA else [torch.float16]
TOL = {torch.bfloat16: 8e-3, torch.float16: 1e-3}  # one rounding of an fp32 sum each side
SHAPES = [(37, 40, 24), (1, 16, 8), (70, 48, 56)]  # (M, K, N): ragged tiles, K past a tile


def triton_test(fn):
    GEMM_TESTS.append(fn.__name__)
    return fn


def needs_gemm():
    if COMMON is None:
        pytest.skip(f"triton is not installed here ({backends.triton_unavailable_reason('situ')})")
    if CUDA and not SM90:
        pytest.skip("the TMA GEMM needs sm90+")
    if not CUDA and not INTERPRETED:
        pytest.skip("interpreted on the CPU: see test_the_interpreted_gemm_suite")


def _rand(g, *shape, dtype, grad=False, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE).requires_grad_(grad)


@triton_test
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gemm_layouts_and_accumulation(dtype, shape):
    needs_gemm()
    from kohakumoss.kernels.triton_gemm import gemm

    M, K, N = shape
    g = torch.Generator().manual_seed(0)
    a, w, c = _rand(g, M, K, dtype=dtype), _rand(g, N, K, dtype=dtype), _rand(g, M, N, dtype=dtype)
    want = a.float() @ w.float().t()
    assert rel(gemm(a, w), want) <= TOL[dtype]
    assert rel(gemm(a, w.t().contiguous(), b_kmajor=False), want) <= TOL[dtype]
    out = c.clone()
    got = gemm(a, w, out, accumulate=True)
    assert got.data_ptr() == out.data_ptr()  # in place
    assert rel(got, want + c.float()) <= TOL[dtype]
    with pytest.raises(ValueError, match=r"\[N, K\] expected"):
        gemm(a, w.t().contiguous())


@triton_test
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("transposed", [False, True], ids=["weight", "weight-view"])
def test_the_linear_op_and_its_gradients(dtype, transposed):
    """Forward, the input gradient (the same kernel, the other layout) and the weight's."""
    needs_gemm()
    fn = KERNELS.backend("linear", "triton").fn
    g = torch.Generator().manual_seed(1)
    x = _rand(g, 2, 19, 48, dtype=dtype, grad=True)
    stored = _rand(g, *((48, 40) if transposed else (40, 48)), dtype=dtype, grad=True)
    w = stored.t() if transposed else stored  # [40, 48] either way
    gy = _rand(g, 2, 19, 40, dtype=dtype)
    y = fn(x, w)
    x32, s32 = x.detach().float().requires_grad_(), stored.detach().float().requires_grad_()
    w32 = s32.t() if transposed else s32
    want = F.linear(x32, w32)
    assert y.shape == want.shape and rel(y, want) <= TOL[dtype]
    dx, ds = torch.autograd.grad(y, (x, stored), gy)
    ex, es = torch.autograd.grad(want, (x32, s32), gy.float())
    assert rel(dx, ex) <= TOL[dtype] and rel(ds, es) <= TOL[dtype]
    acc = _rand(g, 2, 19, 40, dtype=dtype)
    assert rel(fn(x.detach(), w.detach(), acc.clone()), want + acc.float()) <= TOL[dtype]


@triton_test
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lora_nodes_on_the_triton_linear_match_the_reference(dtype):
    """q, k, v as one LoRA node and a lone LoRA linear, their base products on the GEMM: the
    outputs and every gradient as with the reference ``ops.linear``."""
    needs_gemm()
    from kohakumoss.adapters.folded import lora_linear, lora_linears

    fn = KERNELS.backend("linear", "triton").fn
    g = torch.Generator().manual_seed(2)
    x = _rand(g, 21, 32, dtype=dtype, grad=True)
    parts = [(_rand(g, 32, 32, dtype=dtype, scale=0.2), _rand(g, 4, 32, dtype=dtype, grad=True),
              _rand(g, 32, 4, dtype=dtype, grad=True), 0.5) for _ in range(3)]
    gys = [_rand(g, 21, 32, dtype=dtype) for _ in parts]
    leaves = [x, *(t for _, d, u, _ in parts for t in (d, u))]
    results = []
    for linear in (None, fn):
        ys = lora_linears(x, parts, linear)
        w, d, u, alpha = parts[0]
        ys.append(lora_linear(x, w, None, d, u, alpha, linear=linear))
        grads = torch.autograd.grad(ys, leaves, [*gys, gys[0]])
        results.append((ys, grads))
    (ys_ref, g_ref), (ys_tri, g_tri) = results
    for a, b in zip(ys_tri, ys_ref):
        assert rel(a, b) <= TOL[dtype]
    for a, b in zip(g_tri, g_ref):
        assert rel(a, b) <= TOL[dtype]


@triton_test
def test_a_model_whose_table_takes_the_gemm_matches_the_reference():
    """The tiny model in fp16 (bf16 too on a GPU) with ``linear=triton``: its block linears
    run the GEMM (counted), the velocity and every parameter's gradient as the reference's."""
    needs_gemm()
    from kohakumoss.model import cast_model
    from kohakumoss.model.build import tiny_transformer
    from test_kernel_backends import _tiny_inputs

    dtype = torch.bfloat16 if CUDA else torch.float16
    img, text, sigma, layout = _tiny_inputs(dtype)
    layout = layout.to(DEVICE)
    results, calls = [], []
    for choices in ({}, {"linear": "triton"}):
        torch.manual_seed(0)
        model = cast_model(tiny_transformer(), dtype).to(DEVICE)
        model.ops = build_op_table(DEVICE, dtype, choices)
        if choices:
            inner = model.ops.linear
            model.ops.override("linear", lambda *a: calls.append(1) or inner(*a))
        v = model(img.to(dtype), text.to(dtype), sigma, layout)
        v.float().square().mean().backward()
        results.append((v, {n: p.grad for n, p in model.named_parameters()}))
    (v_ref, g_ref), (v_tri, g_tri) = results
    assert len(calls) == 6 * FLAVORS["tiny"].depth  # q, k, v, o, up|gate, down per block
    tol = 2e-2  # roundings that flip compound over the blocks
    assert rel(v_tri, v_ref) <= tol
    for name in g_ref:
        if g_ref[name] is not None:
            assert rel(g_tri[name], g_ref[name]) <= tol, name


def test_plain_linears_go_to_the_op_and_others_to_their_own_call():
    """``ops.linears`` hands a plain bias-free linear to the table's ``linear``; one with a
    bias, a hook or a forward of its own (an adapter) runs its own call."""
    seen = []

    def linear(x, w, acc=None):
        seen.append(w)
        return ops.linear(x, w, acc)

    plain, biased, hooked = (torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(8, 4),
                             torch.nn.Linear(8, 4, bias=False))
    hooked.register_forward_pre_hook(lambda m, a: None)
    x = torch.randn(3, 8)
    out = ops.linears(x, (plain, biased, hooked), linear)
    assert seen == [plain.weight]
    for y, m in zip(out, (plain, biased, hooked)):
        torch.testing.assert_close(y, m(x))
    acc = torch.randn(3, 4)
    torch.testing.assert_close(ops.linear(x, plain.weight, acc.clone()), plain(x) + acc)


def test_the_tuner_sees_the_block_linears_and_the_gemm_its_limits():
    c = FLAVORS["base"]
    shapes = plan_problems(c, [[(4096, 100), (4096, 60)]])["linear"]
    assert sorted((d["K"], d["O"]) for d in shapes.values()) == sorted(
        [(c.dim, c.dim), (c.dim, 2 * c.ffn_dim), (c.ffn_dim, c.dim)])
    assert all(d["N"] == 4096 * 2 + 160 for d in shapes.values())
    b = KERNELS.backend("linear", "triton")
    assert b.takes({"N": 9, "K": 3072, "O": 3072}) and not b.takes({"N": 9, "K": 3070, "O": 3072})
    assert PROBLEMS["linear"].key({"N": 8404, "K": 3072, "O": 3072}) == "N=12288,K=3072,O=3072"
    assert not b.available(torch.device("cpu"), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [8404, 16800])
def test_the_gemm_at_the_real_sizes(tokens):
    """Every block linear's product and input gradient at the published size, bf16."""
    if not SM90:
        pytest.skip("needs a CUDA sm90+ device")
    fn = KERNELS.backend("linear", "triton").fn
    c = FLAVORS["base"]
    g = torch.Generator().manual_seed(3)
    for K, O in ((c.dim, c.dim), (c.dim, 2 * c.ffn_dim), (c.ffn_dim, c.dim)):
        x = _rand(g, tokens, K, dtype=torch.bfloat16, grad=True)
        w = _rand(g, O, K, dtype=torch.bfloat16, scale=K ** -0.5)
        gy = _rand(g, tokens, O, dtype=torch.bfloat16)
        y = fn(x, w)
        (dx,) = torch.autograd.grad(y, (x,), gy)
        assert rel(y, x.detach().float() @ w.float().t()) <= 8e-3
        assert rel(dx, gy.float() @ w.float()) <= 8e-3


def test_the_interpreted_gemm_suite():
    """Reruns this file's Triton tests with ``TRITON_INTERPRET=1`` set before anything imports
    Triton (see ``test_kernel_backends.py``)."""
    if CUDA or INTERPRETED:
        pytest.skip("the Triton tests ran in this process")
    if COMMON is None:
        pytest.skip(f"triton is not installed here ({backends.triton_unavailable_reason('situ')})")
    run_interpreted(Path(__file__), GEMM_TESTS)
