"""``ops.linear``: the block linears' products as an op of the table. The model hands plain
linears to it and the LoRA nodes their base products (``adapters/folded.py``), so a backend
of it (``tilelang``, ``kohakumoss/experimental/tilelang/gemm.py``) serves both. On the CPU: the
routing, the tuner's problems, and the TileLang GEMM lowering to CUDA for sm90 (TMA,
``wgmma``) and sm86 (``cp.async``); ``gpu``: every product and gradient against fp32, the
LoRA nodes and the tiny model on it against the reference, the real sizes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kohakumoss.kernels import KERNELS, backends, build_op_table
from kohakumoss.kernels.problems import PROBLEMS, plan_problems
from kohakumoss.model import FLAVORS, ops
from test_kernel_backends import DEVICE, _tiny_inputs, rel

GEMM = backends.triton_module("experimental.tilelang.gemm")
TOL = {torch.bfloat16: 8e-3, torch.float16: 1e-3}  # one rounding of an fp32 sum each side
DTYPES = [torch.bfloat16, torch.float16]


def needs_gemm(dtype=torch.bfloat16):
    if GEMM is None:
        pytest.skip(f"tilelang cannot be imported here ({backends.unavailable_reason('experimental.tilelang.gemm')})")
    if not GEMM.can_run(DEVICE, dtype):
        pytest.skip(f"the TileLang GEMM does not run {dtype} on {DEVICE} (CUDA sm80+)")


def _rand(g, *shape, dtype, grad=False, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE).requires_grad_(grad)


# ---- CPU --------------------------------------------------------------------------------------

def test_plain_linears_go_to_the_op_and_others_to_their_own_call():
    """``ops.linears`` hands a plain linear (the registry's one rule: bias-free, its call
    claimed by no engine) to the table's ``linear``; one with a bias, or one an engine
    claims (a weight ring's loads, an adapter's forward), runs its own call."""
    from kohakumoss.model.engines import EngineRegistry, Handle

    seen = []

    def linear(x, w, acc=None):
        seen.append(w)
        return ops.linear(x, w, acc)

    plain, biased, claimed = (torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(8, 4),
                              torch.nn.Linear(8, 4, bias=False))
    registry = EngineRegistry()
    handle = registry.register(Handle("an engine", linears=(claimed,)))
    x = torch.randn(3, 8)
    out = ops.linears(x, (plain, biased, claimed), linear, plain=registry.plain_linear)
    assert seen == [plain.weight]
    for y, m in zip(out, (plain, biased, claimed)):
        torch.testing.assert_close(y, m(x))
    registry.remove(handle)  # unclaimed: plain again
    seen.clear()
    ops.linears(x, (plain, biased, claimed), linear, plain=registry.plain_linear)
    assert seen == [plain.weight, claimed.weight]
    acc = torch.randn(3, 4)
    torch.testing.assert_close(ops.linear(x, plain.weight, acc.clone()), plain(x) + acc)


def test_the_model_runs_every_block_linear_through_its_table():
    from kohakumoss.model.build import tiny_transformer

    img, text, sigma, layout = _tiny_inputs(torch.float32)
    model = tiny_transformer().to(DEVICE)
    want = model(img, text, sigma, layout.to(DEVICE))
    calls = []
    model.ops.override("linear", lambda x, w, acc=None: calls.append(tuple(w.shape)) or ops.linear(x, w, acc))
    torch.testing.assert_close(model(img, text, sigma, layout.to(DEVICE)), want, rtol=0, atol=0)
    c = FLAVORS["tiny"]
    assert len(calls) == 6 * c.depth  # q, k, v, o, up|gate, down per joint block
    assert calls.count((2 * c.ffn_dim, c.dim)) == c.depth and calls.count((c.dim, c.ffn_dim)) == c.depth


def test_lora_nodes_take_their_base_products_from_the_op():
    """q, k, v as one LoRA node and a lone LoRA linear call ``linear`` for every base product
    (forward and input gradient), and match the reference routing."""
    from kohakumoss.adapters.folded import lora_linear, lora_linears

    g = torch.Generator().manual_seed(2)
    x = torch.randn(21, 32, generator=g, requires_grad=True)
    parts = [(torch.randn(32, 32, generator=g) * 0.2, torch.randn(4, 32, generator=g).requires_grad_(),
              torch.randn(32, 4, generator=g).requires_grad_(), 0.5) for _ in range(3)]
    seen = []

    def linear(a, w, acc=None):
        seen.append(w.is_contiguous())
        return ops.linear(a, w, acc)

    for fn in (None, linear):
        ys = lora_linears(x, parts, fn)
        w, d, u, alpha = parts[0]
        ys.append(lora_linear(x, w, None, d, u, alpha, linear=fn))
        grads = torch.autograd.grad(ys, [x, *(t for _, d, u, _ in parts for t in (d, u))],
                                    [torch.ones_like(y) for y in ys])
        if fn is None:
            want = (ys, grads)
    for a, b in zip([*ys, *grads], [*want[0], *want[1]]):
        torch.testing.assert_close(a, b)
    assert seen.count(True) == 4 and seen.count(False) == 4  # forward [O, K]; input grad W^T views


def test_the_tuner_sees_the_block_linears_and_the_backend_its_limits():
    c = FLAVORS["base"]
    shapes = plan_problems(c, [[(4096, 100), (4096, 60)]])["linear"]
    assert sorted((d["K"], d["O"]) for d in shapes.values()) == sorted(
        [(c.dim, c.dim), (c.dim, 2 * c.ffn_dim), (c.ffn_dim, c.dim)])
    assert all(d["N"] == 4096 * 2 + 160 for d in shapes.values())
    assert PROBLEMS["linear"].key({"N": 8404, "K": 3072, "O": 3072}) == "N=12288,K=3072,O=3072"
    b = KERNELS.backend("linear", "tilelang")
    assert b.takes({"N": 9, "K": 3072, "O": 3072}) and not b.takes({"N": 9, "K": 3070, "O": 3072})
    assert not b.available(torch.device("cpu"), torch.bfloat16)
    assert b.keeps_inputs_only and b.opt_in is not None


@pytest.mark.parametrize("arch,tiles,code", [("sm_90", "SM90_TILES", "wgmma"), ("sm_86", "SM80_TILES", "cp_async")])
def test_the_gemm_lowers_to_cuda(arch, tiles, code):
    """sm90: TMA copies feeding ``wgmma`` (the accumulating forward); sm86: ``cp.async`` and
    ``mma.sync`` (the input gradient's layout). The GPU tests run sm90."""
    if GEMM is None:
        pytest.skip(f"tilelang cannot be imported here ({backends.unavailable_reason('experimental.tilelang.gemm')})")
    import tilelang
    from tilelang import tvm

    kmajor, accumulate = arch == "sm_90", arch == "sm_90"
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    with target:
        source = tilelang.lower(GEMM.gemm_kernel(3072, 16384, "bfloat16", kmajor, accumulate,
                                                 *getattr(GEMM, tiles)), target=target).kernel_source
    assert "__global__" in source and code in source


# ---- GPU --------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(37, 40, 24), (1, 16, 8), (300, 96, 264)], ids=str)
def test_gemm_layouts_and_accumulation(dtype, shape):
    needs_gemm(dtype)
    M, K, N = shape
    g = torch.Generator().manual_seed(0)
    a, w, c = _rand(g, M, K, dtype=dtype), _rand(g, N, K, dtype=dtype), _rand(g, M, N, dtype=dtype)
    want = a.float() @ w.float().t()
    assert rel(GEMM.gemm(a, w), want) <= TOL[dtype]
    assert rel(GEMM.gemm(a, w.t().contiguous(), b_kmajor=False), want) <= TOL[dtype]
    out = c.clone()
    got = GEMM.gemm(a, w, out, accumulate=True)
    assert got.data_ptr() == out.data_ptr() and rel(got, want + c.float()) <= TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("transposed", [False, True], ids=["weight", "weight-view"])
def test_the_op_and_its_gradients(dtype, transposed):
    needs_gemm(dtype)
    fn = KERNELS.backend("linear", "tilelang").fn
    g = torch.Generator().manual_seed(1)
    x = _rand(g, 2, 19, 48, dtype=dtype, grad=True)
    stored = _rand(g, *((48, 40) if transposed else (40, 48)), dtype=dtype, grad=True)
    w = stored.t() if transposed else stored
    gy = _rand(g, 2, 19, 40, dtype=dtype)
    y = fn(x, w)
    x32, s32 = x.detach().float().requires_grad_(), stored.detach().float().requires_grad_()
    want = F.linear(x32, s32.t() if transposed else s32)
    assert rel(y, want) <= TOL[dtype]
    for a, b in zip(torch.autograd.grad(y, (x, stored), gy), torch.autograd.grad(want, (x32, s32), gy.float())):
        assert rel(a, b) <= TOL[dtype]
    acc = _rand(g, 2, 19, 40, dtype=dtype)
    assert rel(fn(x.detach(), w.detach(), acc.clone()), want + acc.float()) <= TOL[dtype]


@pytest.mark.gpu
def test_the_tiny_model_and_its_lora_on_the_gemm_match_the_reference():
    """The tiny model in bf16 with a rank-4 LoRA on every block linear, ``linear=tilelang``
    against the reference: the velocity and every trained gradient."""
    needs_gemm()
    from kohakumoss.adapters import apply_adapters
    from kohakumoss.config import AdapterConfig
    from kohakumoss.model import cast_model
    from kohakumoss.model.build import tiny_transformer

    img, text, sigma, layout = _tiny_inputs(torch.bfloat16)
    results = []
    for choices in ({}, {"linear": "tilelang"}):
        torch.manual_seed(0)
        model = cast_model(tiny_transformer(), torch.bfloat16).to(DEVICE)
        model.ops = build_op_table(DEVICE, torch.bfloat16, choices)
        adapters = apply_adapters(model, AdapterConfig(algo="lora", preset="attn-mlp", dim=4, alpha=4.0), seed=0)
        adapters.to(DEVICE)
        with torch.no_grad():
            for p in adapters.trainable_parameters():
                p.normal_(std=0.05)
        v = model(img.to(torch.bfloat16), text.to(torch.bfloat16), sigma, layout.to(DEVICE))
        v.float().square().mean().backward()
        results.append((v, {n: p.grad for n, p in adapters.named_trainable()}))
    (v_ref, g_ref), (v_tl, g_tl) = results
    assert rel(v_tl, v_ref) <= 2e-2
    for name in g_ref:
        assert rel(g_tl[name], g_ref[name]) <= 2e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [8399, 16800])
def test_the_gemm_at_the_real_sizes(tokens):
    needs_gemm()
    fn = KERNELS.backend("linear", "tilelang").fn
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
