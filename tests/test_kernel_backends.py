"""Every kernel backend (each op's folder of ``kohakumoss/kernels/``) against its reference
(``kohakumoss/model/ops.py``): the forward and every input gradient, over shapes (segment
lengths 1, odd and long; several samples; heads; head dims) and dtypes, with a relative
error ``||ours - ref|| / ||ref||`` under a tolerance per dtype.

Where the Triton kernels run: on a CUDA machine, compiled, at these small shapes and (the
``gpu`` tests) at the real model's; on a CPU machine, interpreted. Interpretation is decided
when ``triton`` is first imported (``TRITON_INTERPRET=1``), and in a test session something
(``torch._dynamo``, through lycoris) imports it long before this module, so on a CPU machine
``test_the_interpreted_suite`` reruns this file in a subprocess with ``TRITON_INTERPRET=1``
and the in-process Triton tests skip, pointing there. Without Triton they skip, saying so.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kohakumoss.diffusion.objective import reference_flow_loss
from kohakumoss.diffusion.sampler import skipping
from kohakumoss.kernels import KERNELS, backends, build_op_table
from kohakumoss.model import FLAVORS, build_layout, ops

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
COMMON = backends.triton_module("kernels.triton_common")
INTERPRETED = COMMON is not None and COMMON.INTERPRETED

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# one rounding out of fp32 math on both sides: they differ where fp32 sums (row norms, the
# per-sample and per-weight reductions) land on either side of a rounding boundary
TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}
# attention: a differently blocked softmax, exp and accumulation in the kernel
ATTENTION_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
ELEMENTWISE = ["rms_norm", "modulated_rms_norm", "qk_norm_rope", "situ", "residual",
               "gated_residual"]
LENGTHS = {"one": [1], "odd": [5], "mixed": [1, 7, 3], "long": [37]}


def _ids(d):
    return str(d).removeprefix("torch.")


TRITON_TESTS: list[str] = []  # what test_the_interpreted_suite reruns


def triton_test(fn):
    TRITON_TESTS.append(fn.__name__)
    return fn


def needs_triton():
    if COMMON is None:
        pytest.skip(f"triton is not installed here ({backends.triton_unavailable_reason('situ')})")
    if not CUDA and not INTERPRETED:
        pytest.skip("the Triton kernels run interpreted on the CPU: see test_the_interpreted_suite")


def rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    a, b = ours.detach().double(), ref.detach().double()
    assert a.shape == b.shape, (a.shape, b.shape)
    d, n = (a - b).norm(), b.norm()
    return float(d / n) if n > 0 else float(d)


def leaf(g: torch.Generator, *shape, dtype=torch.float32, scale=1.0, grad=True):
    t = (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)
    return t.requires_grad_(grad)


def seg_of(lengths: list[int], shuffle: bool = False,
           g: torch.Generator | None = None) -> torch.Tensor:
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    if shuffle:  # sample ids in any order: the backward's per-sample grouping must not care
        seg = seg[torch.randperm(len(seg), generator=g)]
    return seg.to(DEVICE)


def compare(fn, ref, args, leaves: dict[str, torch.Tensor], tol: float, seed: int = 1) -> None:
    """``fn(*args)`` against ``ref(*args)``: output and the gradient of every leaf."""
    out, want = fn(*args), ref(*args)
    assert out.dtype == want.dtype and out.shape == want.shape
    err = rel(out, want)
    assert err <= tol, f"forward: relative error {err:.2e} > {tol:.0e}"
    g = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(want.shape, generator=g).to(want.dtype).to(DEVICE)
    names = list(leaves)
    # the reference first, keeping what the two share (cos and sin of one theta); the backend
    # last and once, as a training step differentiates it (compiled flex donates its buffers)
    exp = torch.autograd.grad(want, [leaves[n] for n in names], grad_out, retain_graph=True)
    got = torch.autograd.grad(out, [leaves[n] for n in names], grad_out)
    for name, a, b in zip(names, got, exp):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        err = rel(a, b)
        assert err <= tol, f"d{name}: relative error {err:.2e} > {tol:.0e}"


def triton_fn(op: str):
    return KERNELS.backend(op, "triton").fn


# ---- the elementwise ops in Triton ---------------------------------------------------------

@triton_test
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_rms_norm(lengths, dtype):
    needs_triton()
    g = torch.Generator().manual_seed(0)
    N = sum(lengths)
    for shape in [(N, 48), (2, N, 64)]:  # any leading shape; a width that is no power of 2
        x, w = leaf(g, *shape, dtype=dtype), leaf(g, shape[-1], dtype=dtype, scale=0.2)
        w.data += 1
        compare(triton_fn("rms_norm"), ops.rms_norm, (x, w, 1e-6), {"x": x, "weight": w},
                TOL[dtype])


@triton_test
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_modulated_rms_norm(lengths, dtype):
    needs_triton()
    g = torch.Generator().manual_seed(1)
    N, D, B = sum(lengths), 48, len(lengths)
    for shuffle in (False, True):
        x, w = leaf(g, N, D, dtype=dtype), leaf(g, D, dtype=dtype, scale=0.2)
        shift, scale = leaf(g, B, D, scale=0.5), leaf(g, B, D, scale=0.5)
        seg = seg_of(lengths, shuffle, g)
        compare(triton_fn("modulated_rms_norm"), ops.modulated_rms_norm,
                (x, w, shift, scale, seg, 1e-6),
                {"x": x, "weight": w, "shift": shift, "scale": scale}, TOL[dtype])


@triton_test
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("lengths", [LENGTHS["mixed"], LENGTHS["long"]], ids=["mixed", "long"])
def test_a_halfs_norm_sums_the_closing_adds_gradient_in_its_kernel(lengths, dtype):
    """``ops.stream_norm`` on the Triton norm returns ``(norm(x), x)`` through one node whose
    backward adds the closing gated add's gradient of x to the norm's own in the kernel. The
    half ``x + gate * (norm(x) m)`` against the references' (samples in order and shuffled;
    only x trained, as a LoRA run; then weight and modulation too)."""
    needs_triton()
    g = torch.Generator().manual_seed(21)
    N, D, B = sum(lengths), 48, len(lengths)

    def half(norm, gated):
        def run(x, w, shift, scale, seg, gate, m):
            y, x_res = ops.stream_norm(norm, x, w, shift, scale, seg, 1e-6)
            return gated(x_res, y @ m, gate, seg)
        return run

    mine, ref = half(KERNELS.backend("modulated_rms_norm", "triton").entry(), triton_fn("gated_residual")), half(ops.modulated_rms_norm, ops.gated_residual)
    for shuffle, wants in ((False, []), (True, []), (True, ["weight", "shift", "scale"])):
        x, m = leaf(g, N, D, dtype=dtype), leaf(g, D, D, dtype=dtype, scale=D ** -0.5, grad=False)
        w = leaf(g, D, dtype=dtype, grad="weight" in wants)
        shift, scale = (leaf(g, B, D, scale=0.5, grad=n in wants) for n in ("shift", "scale"))
        gate = leaf(g, B, D, grad=False)
        args = (x, w, shift, scale, seg_of(lengths, shuffle, g), gate, m)
        assert "_StreamNormBackward" in _graph(mine(*args))
        named = {"x": x, "weight": w, "shift": shift, "scale": scale}
        compare(mine, ref, args, {k: named[k] for k in ["x", *wants]}, TOL[dtype])


@triton_test
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("lengths", [LENGTHS["one"], LENGTHS["mixed"], LENGTHS["long"]],
                         ids=["one", "mixed", "long"])
def test_the_norm_that_makes_the_closing_add(lengths, dtype):
    """The Triton norm's ``added`` form (``ops.added_norm``, inference): ``s = x + gate y``
    comes back as the Triton gated add writes it, bit for bit, and the norm of s as the
    references make it (samples in order and shuffled; shift, scale and gate as the model's
    strided columns of one tensor)."""
    needs_triton()
    form = KERNELS.backend("modulated_rms_norm", "triton").forms["added"]
    g = torch.Generator().manual_seed(23)
    N, D, B = sum(lengths), 48, len(lengths)
    for shuffle in (False, True):
        x, y = leaf(g, N, D, dtype=dtype, grad=False), leaf(g, N, D, dtype=dtype, grad=False)
        w = leaf(g, D, dtype=dtype, scale=0.2, grad=False) + 1
        mod = leaf(g, B, 6, D, scale=0.5, grad=False)
        seg = seg_of(lengths, shuffle, g)
        out, s = form(x, w, mod[:, 3], mod[:, 4], seg, 1e-6, y, mod[:, 2])
        want_s = triton_fn("gated_residual")(x, y, mod[:, 2], seg)
        assert s.dtype == x.dtype and torch.equal(s, want_s)
        assert rel(s, ops.gated_residual(x, y, mod[:, 2], seg)) <= TOL[dtype]
        want = ops.modulated_rms_norm(s, w, mod[:, 3], mod[:, 4], seg, 1e-6)
        assert out.dtype == want.dtype and rel(out, want) <= TOL[dtype]
        assert torch.equal(out, triton_fn("modulated_rms_norm")(s, w, mod[:, 3], mod[:, 4], seg, 1e-6))


@triton_test
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_the_added_form_gives_x_and_y_their_gradients_and_declines_the_rest(dtype):
    """Under autograd the ``added`` form is one node for x and y's gradients (the references'
    add then norm, with s also used by a later add); where the weight, the modulation or the
    gate needs a gradient it returns None, and the caller makes the add and the norm apart."""
    needs_triton()
    form = KERNELS.backend("modulated_rms_norm", "triton").forms["added"]
    g = torch.Generator().manual_seed(24)
    lengths = [5, 1, 9]
    N, D, B = sum(lengths), 48, len(lengths)
    x, y = leaf(g, N, D, dtype=dtype), leaf(g, N, D, dtype=dtype)
    w = leaf(g, D, dtype=dtype, grad=False)
    mod = leaf(g, B, 6, D, scale=0.5, grad=False)
    m = leaf(g, D, D, dtype=dtype, scale=D ** -0.5, grad=False)
    seg = seg_of(lengths, True, g)

    def half(added):  # (norm(s) m) summed with s, as a later add reads the stream
        def run(x, y):
            out, s = added(x, y)
            return ops.gated_residual(s, out @ m, mod[:, 5], seg)
        return run

    def reference(x, y):
        s = ops.gated_residual(x, y, mod[:, 2], seg)
        return ops.modulated_rms_norm(s, w, mod[:, 0], mod[:, 1], seg, 1e-6), s

    mine = half(lambda x, y: form(x, w, mod[:, 0], mod[:, 1], seg, 1e-6, y, mod[:, 2]))
    assert "_AddedNormBackward" in _graph(mine(x, y))
    compare(mine, half(reference), (x, y), {"x": x, "y": y}, TOL[dtype])
    for trained in ("weight", "shift", "gate"):
        args = [x, w, mod[:, 0], mod[:, 1], seg, 1e-6, y, mod[:, 2]]
        at = {"weight": 1, "shift": 2, "gate": 7}[trained]
        args[at] = args[at].detach().clone().requires_grad_()
        assert form(*args) is None, trained
    with torch.no_grad():
        with pytest.raises(ValueError, match="want y as x, gate as shift"):
            form(x, w, mod[:, 0], mod[:, 1], seg, 1e-6, y[:, :8], mod[:, 2])
        with pytest.raises(ValueError, match="want y as x, gate as shift"):
            form(x, w, mod[:, 0], mod[:, 1], seg, 1e-6, y, mod[:1, 2])


@triton_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
def test_a_chained_forward_is_the_blockwise_forward(dtype):
    """Without autograd the joint blocks run ``chained`` (each half's closing add made by the
    next norm): with the references the output is the block-by-block forward's bit for bit,
    and with the Triton table it is too, its gated adds but the last made inside the norms'
    kernels; CFG's skipped layer (the negatives last) closes the chain before it."""
    needs_triton()
    from kohakumoss.model import cast_model
    from kohakumoss.model.build import tiny_transformer

    img, text, sigma, layout = _tiny_inputs(dtype)
    layout = layout.to(DEVICE)
    for choices in ({}, {op: "triton" for op in ELEMENTWISE}):
        model = cast_model(tiny_transformer(), dtype).to(DEVICE)
        model.ops = build_op_table(DEVICE, dtype, choices)
        adds = []
        gated = model.ops.gated_residual
        model.ops.override("gated_residual", lambda *a: adds.append(1) or gated(*a))
        for skip in ((), (1,)):
            kw = dict(replace=skipping(skip, (False, False, True))) if skip else {}
            with torch.no_grad():
                model.chain_adds = False
                assert not any(model.chained_blocks())
                want = model(img, text, sigma, layout, **kw)
                adds.clear()
                model.chain_adds = True
                assert all(model.chained_blocks())
                got = model(img, text, sigma, layout, **kw)
            assert torch.equal(got, want), (choices, skip)
            # the references make every half's add (2 a block run); the Triton norms make all
            # but the chain's last, before the head, and its last before the skipped layer,
            # which runs whole (its own 2)
            assert len(adds) == (1 + 3 * len(skip) if choices else 2 * model.config.depth)
        model.chain_adds = False
        assert not any(model.chained_blocks())


@triton_test
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("trained", ["linears", "everything"])
def test_a_chained_training_step_is_the_blockwise_one(trained, dtype):
    """Under autograd too: the loss and every gradient of the chained forward are the block
    forward's, bit for bit, with the references and with the Triton table. Where only the
    linears train (an adapter run's case: norms and modulation frozen) the Triton norms' added
    form is one node (``_AddedNorm``) whose backward makes the branch's gradient in the
    norm's kernel; where everything trains it declines and the add and the norm run apart."""
    needs_triton()
    from kohakumoss.model import cast_model
    from kohakumoss.model.build import tiny_transformer

    img, text, sigma, layout = _tiny_inputs(dtype)
    layout = layout.to(DEVICE)
    for choices in ({}, {op: "triton" for op in ELEMENTWISE}):
        runs = []
        for chain in (False, True):
            model = cast_model(tiny_transformer(), dtype).to(DEVICE)
            model.ops = build_op_table(DEVICE, dtype, choices)
            for name, p in model.named_parameters():
                p.requires_grad_(trained == "everything" or ".proj." in name)
            model.chain_adds = chain
            assert model.chained_blocks() == [chain] * model.config.depth
            v = model(img, text, sigma, layout)
            graph = _graph(v)
            v.float().square().mean().backward()
            runs.append((v, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
        assert ("_AddedNormBackward" in graph) == (bool(choices) and trained == "linears")
        (v_a, g_a), (v_b, g_b) = runs
        assert torch.equal(v_a, v_b) and g_a.keys() == g_b.keys() and g_a
        for name in g_a:
            assert torch.equal(g_a[name], g_b[name]), (choices, name)


@triton_test
@pytest.mark.parametrize("launch", [(2, 2), (4, 8)], ids=str)
def test_every_row_launch_of_the_norms_gives_their_results(launch, monkeypatch):
    """A row kernel's launch (rows per program, warps; what ``bench/bench_norm_launch.py``
    sweeps, and ``triton_norm.LAUNCH`` would hold) for each kind: the norm, the norm that
    makes the add, dx alone, dx with the branch's gradient; the results are the default
    launch's (row counts that leave a partial last tile, samples shuffled)."""
    needs_triton()
    module = backends.triton_module("kernels.norm.triton")
    g = torch.Generator().manual_seed(31)
    lengths = [7, 1, 6]
    N, D, B = sum(lengths), 48, len(lengths)
    x, y, go, res = (leaf(g, N, D, dtype=torch.bfloat16, grad=False) for _ in range(4))
    w = leaf(g, D, dtype=torch.bfloat16, grad=False)
    mod = leaf(g, B, 3, D, scale=0.5, grad=False)
    seg = seg_of(lengths, True, g)
    calls = {
        "forward": lambda launch=None: [module._forward(x, w, mod[:, 0], mod[:, 1], seg, 1e-6, True,
                                                        launch=launch)],
        "added": lambda launch=None: list(module._forward(x, w, mod[:, 0], mod[:, 1], seg, 1e-6, True,
                                                          (y, mod[:, 2]), launch=launch)),
        "rows": lambda launch=None: [module._backward(go, x, w, mod[:, 1], seg, 1e-6, True, False,
                                                      False, res, launch=launch)[0]],
        "gated": lambda launch=None: list(module.backward_added(go, x, w, mod[:, 1], seg, 1e-6, res,
                                                                mod[:, 2], torch.bfloat16, launch=launch)),
    }
    seen = []

    class Spy:  # records each launch's grid, rows per program and warps
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def run(*args, **kw):
                seen.append((grid[0], kw["BLOCK_R"], kw["num_warps"]))
                return self.kernel[grid](*args, **kw)
            return run

    for name in ("_norm_fwd", "_norm_bwd_rows"):
        monkeypatch.setattr(module, name, Spy(getattr(module, name)))
    for kind, call in calls.items():
        want = call()
        got = call(launch)
        assert seen[-1] == (-(-N // launch[0]), *launch), (kind, seen[-1])
        assert all(rel(a, b) <= TOL[torch.bfloat16] for a, b in zip(got, want)), kind
        if INTERPRETED:  # numpy's row sums do not depend on the launch
            assert all(torch.equal(a, b) for a, b in zip(got, want)), kind


@triton_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
def test_norms_of_an_adapter_run(dtype):
    """Frozen norm weights and modulation (LoRA): only x takes a gradient, and the kernels
    make no reductions (samples in order and shuffled); and each of weight, shift, scale
    needing one alone."""
    needs_triton()
    g = torch.Generator().manual_seed(14)
    lengths = [9, 1, 4]
    N, D, B = sum(lengths), 64, len(lengths)
    seg = seg_of(lengths)
    x = leaf(g, N, D, dtype=dtype)
    w = leaf(g, D, dtype=dtype, grad=False)
    compare(triton_fn("rms_norm"), ops.rms_norm, (x, w, 1e-6), {"x": x}, TOL[dtype])
    for wants in ([], ["weight"], ["shift"], ["scale"]):
        w = leaf(g, D, dtype=dtype, grad="weight" in wants)
        shift = leaf(g, B, D, scale=0.5, grad="shift" in wants)
        scale = leaf(g, B, D, scale=0.5, grad="scale" in wants)
        named = {"x": x, "weight": w, "shift": shift, "scale": scale}
        compare(triton_fn("modulated_rms_norm"), ops.modulated_rms_norm,
                (x, w, shift, scale, seg, 1e-6), {k: named[k] for k in ["x", *wants]}, TOL[dtype])
    # dx alone walks the rows in token order, each row's scale by its sample: any seg order
    shuffled = seg_of(lengths, True, g)
    compare(triton_fn("modulated_rms_norm"), ops.modulated_rms_norm,
            (x, w, shift.detach(), scale.detach(), shuffled, 1e-6), {"x": x}, TOL[dtype])


@triton_test
def test_modulated_rms_norm_with_columns_of_one_tensor_and_an_fp32_weight():
    """The model's case: shift and scale are strided views of one [B, 6, D] tensor; and a
    16-bit stream with an fp32 weight (a full finetune under autocast)."""
    needs_triton()
    g = torch.Generator().manual_seed(2)
    lengths = [6, 1, 9]
    N, D, B = sum(lengths), 64, len(lengths)
    x, w = leaf(g, N, D, dtype=torch.bfloat16), leaf(g, D, scale=0.2)
    mod = leaf(g, B, 6, D, scale=0.5)
    shift, scale = mod[:, 3], mod[:, 4]
    compare(triton_fn("modulated_rms_norm"), ops.modulated_rms_norm,
            (x, w, shift, scale, seg_of(lengths), 1e-6), {"x": x, "weight": w, "mod": mod},
            TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("lengths,heads,head_dim", [(LENGTHS["one"], 1, 16),
                                                    (LENGTHS["mixed"], 3, 24),
                                                    (LENGTHS["long"], 2, 32)],
                         ids=["one-1x16", "mixed-3x24", "long-2x32"])
@triton_test
def test_qk_norm_rope(lengths, heads, head_dim, dtype):
    needs_triton()
    g = torch.Generator().manual_seed(3)
    N = sum(lengths)
    x, w = leaf(g, N, heads, head_dim, dtype=dtype), leaf(g, head_dim, dtype=dtype, scale=0.2)
    theta = leaf(g, N, head_dim // 2, scale=3.0, grad=False)
    cos, sin = theta.cos(), theta.sin()  # fp32, as rope_angles gives a 16-bit model
    compare(triton_fn("qk_norm_rope"), ops.qk_norm_rope, (x, w, cos, sin, 1e-6),
            {"x": x, "weight": w}, TOL[dtype])


@triton_test
def test_qk_norm_rope_gives_gradients_to_cos_and_sin_when_they_need_them():
    needs_triton()
    g = torch.Generator().manual_seed(4)
    N, H, Dh = 9, 3, 16
    x, w = leaf(g, N, H, Dh), leaf(g, Dh)
    theta = leaf(g, N, Dh // 2, scale=3.0)
    compare(triton_fn("qk_norm_rope"), ops.qk_norm_rope,
            (x, w, theta.cos(), theta.sin(), 1e-6), {"x": x, "weight": w, "theta": theta}, 1e-5)


@triton_test
def test_qk_norm_rope_on_a_strided_view():
    """The text blocks' q and k are views of one fused qkv output."""
    needs_triton()
    g = torch.Generator().manual_seed(5)
    N, H, Dh = 11, 2, 32
    qkv = leaf(g, N, 3 * H * Dh, dtype=torch.bfloat16)
    q = qkv.view(N, 3, H, Dh).unbind(1)[1]
    w = leaf(g, Dh, dtype=torch.bfloat16)
    theta = leaf(g, N, Dh // 2, grad=False)
    compare(triton_fn("qk_norm_rope"), ops.qk_norm_rope, (q, w, theta.cos(), theta.sin(), 1e-6),
            {"qkv": qkv, "weight": w}, TOL[torch.bfloat16])


def _graph(out: torch.Tensor) -> set[str]:
    """The names of the autograd nodes behind ``out``."""
    seen, todo = {}, [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and id(node) not in seen:
            seen[id(node)] = node  # held, so no later node reuses its id
            todo.extend(n for n, _ in node.next_functions)
    return {type(n).__name__ for n in seen.values()}


@triton_test
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("shape", [(1, 40), (7, 130), (37, 64)], ids=str)
def test_situ(shape, dtype):
    """u and g as the column halves of one fused up-gate output (strided views), over the
    ranges where both tanh saturate (|u| >> 25, |g| >> 4) and near zero."""
    needs_triton()
    g = torch.Generator().manual_seed(6)
    N, F = shape
    ug = leaf(g, N, 2 * F, dtype=dtype, scale=20.0)
    with torch.no_grad():
        ug[:, ::3] *= 1e-3
    u, gate = ug.split(F, dim=-1)
    compare(triton_fn("situ"), ops.situ, (u, gate), {"ug": ug}, TOL[dtype])
    # the halves of one tensor: the kernel's gradient is ug's, written whole (no split's
    # backward concatenating them); in the other order they are two separate inputs
    assert "SplitBackward0" not in _graph(triton_fn("situ")(u, gate))
    assert "SplitBackward0" in _graph(triton_fn("situ")(gate, u))
    compare(triton_fn("situ"), ops.situ, (gate, u), {"ug": ug}, TOL[dtype])
    u, gate = leaf(g, N, F, dtype=dtype, scale=4.0), leaf(g, N, F, dtype=dtype, scale=4.0)
    compare(triton_fn("situ"), ops.situ, (u, gate), {"u": u, "g": gate}, TOL[dtype])


@triton_test
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("shape", [(1, 48), (37, 64), (2, 5, 48)], ids=str)
def test_residual(shape, dtype):
    needs_triton()
    g = torch.Generator().manual_seed(7)
    x, y = leaf(g, *shape, dtype=dtype), leaf(g, *shape, dtype=dtype, scale=0.01)
    compare(triton_fn("residual"), ops.residual, (x, y), {"x": x, "y": y}, TOL[dtype])


def check_gated_residual(fn, lengths, dtype) -> None:
    """``fn`` against ``ops.gated_residual``: samples in order and shuffled, then a frozen gate
    (LoRA: the modulation takes no gradient, so a kernel may skip its reduction)."""
    g = torch.Generator().manual_seed(8)
    N, D, B = sum(lengths), 48, len(lengths)
    for shuffle in (False, True):
        x, y = leaf(g, N, D, dtype=dtype), leaf(g, N, D, dtype=dtype)
        gate = leaf(g, B, D, scale=0.3)
        seg = seg_of(lengths, shuffle, g)
        compare(fn, ops.gated_residual, (x, y, gate, seg), {"x": x, "y": y, "gate": gate},
                TOL[dtype])
    gate = leaf(g, B, D, scale=0.3, grad=False)
    compare(fn, ops.gated_residual, (x, y, gate, seg), {"x": x, "y": y}, TOL[dtype])
    # y is kept for the gate's per-sample sums alone: with a frozen gate the node keeps none
    for frozen in (True, False):
        kept = []
        gate = leaf(g, B, D, scale=0.3, grad=not frozen)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.data_ptr()) or t, lambda t: t):
            fn(x, y, gate, seg)
        assert (y.data_ptr() in kept) != frozen, (frozen, kept)


@triton_test
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_gated_residual(lengths, dtype):
    needs_triton()
    check_gated_residual(triton_fn("gated_residual"), lengths, dtype)


@triton_test
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("loss", ["mse", "l1", "huber"])
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_flow_loss(lengths, loss, dtype):
    """The fused loss against ``ops.flow_loss``: the value (fp32) and pred's gradient, with
    per-sample weights, tokens in any sample order, 128 channels (the latent's) and an odd
    width, and huber errors on both sides of delta."""
    needs_triton()
    g = torch.Generator().manual_seed(12)
    N, B = sum(lengths), len(lengths)
    for C, shuffle in ((128, False), (37, True)):
        pred = leaf(g, N, C, dtype=dtype, scale=1.5)
        target = leaf(g, N, C, grad=False)
        weight = (torch.rand(B, generator=g) + 0.5).to(DEVICE)
        seg = seg_of(lengths, shuffle, g)
        args = (pred, target, seg, weight, 3 * N + 1, loss, 0.7)
        out, want = triton_fn("flow_loss")(*args), reference_flow_loss(*args)
        assert out.dtype == want.dtype == torch.float32 and out.shape == want.shape == ()
        assert rel(out, want) <= 1e-5, (float(out), float(want))
        go = torch.tensor(0.3, device=DEVICE)
        got, = torch.autograd.grad(out, pred, go)
        exp, = torch.autograd.grad(want, pred, go)
        assert got.dtype == exp.dtype == dtype
        assert rel(got, exp) <= TOL[dtype], f"dpred: relative error {rel(got, exp):.2e}"


@triton_test
def test_every_triton_op_passes_opcheck():
    """``torch.library.opcheck``: the schema, the autograd registration, the fake (meta)
    implementation against the real one, and AOT dispatch with dynamic shapes, which is
    what ``torch.compile`` relies on to see through the kernels."""
    needs_triton()
    for module in set(backends.TRITON_OPS.values()):  # imported on first use: registers the ops
        backends.triton_module(module)
    K = torch.ops.kohakumoss
    g = torch.Generator().manual_seed(13)
    N, D, B, H, Dh = 7, 32, 2, 2, 16
    seg = seg_of([3, 4])
    cases = {
        "triton_rms_norm": (leaf(g, N, D), leaf(g, D), 1e-6),
        "triton_modulated_rms_norm": (leaf(g, N, D), leaf(g, D), leaf(g, B, D), leaf(g, B, D),
                                      seg, 1e-6),
        "triton_qk_norm_rope": (leaf(g, N, H, Dh), leaf(g, Dh), leaf(g, N, Dh // 2, grad=False),
                                leaf(g, N, Dh // 2, grad=False), 1e-6),
        "triton_situ": (leaf(g, N, D, dtype=torch.bfloat16), leaf(g, N, D, dtype=torch.bfloat16)),
        "triton_residual": (leaf(g, N, D, dtype=torch.bfloat16), leaf(g, N, D)),
        "triton_gated_residual": (leaf(g, N, D), leaf(g, N, D), leaf(g, B, D), seg),
        "triton_flow_loss": (leaf(g, N, D, dtype=torch.bfloat16), leaf(g, N, D, grad=False), seg,
                             leaf(g, B, grad=False), 11, "huber", 0.5),
    }
    for name, args in cases.items():
        result = torch.library.opcheck(getattr(K, name).default, args)
        assert set(result.values()) == {"SUCCESS"}, (name, result)


@triton_test
def test_torch_compile_sees_through_the_triton_ops():
    """Compiled (Dynamo + AOTAutograd: the custom ops and their fake implementations), a
    block's elementwise chain gives the eager result and gradients, and makes one graph."""
    needs_triton()
    g = torch.Generator().manual_seed(15)
    N, D, H = 10, 32, 2
    seg = seg_of([4, 6])
    x, w, wq = leaf(g, N, D), leaf(g, D), leaf(g, D // H)
    mod = leaf(g, 2, 3, D, scale=0.5)
    theta = leaf(g, N, D // H // 2, grad=False)
    fn = {op: triton_fn(op) for op in ELEMENTWISE}

    def chain(x, w, wq, mod):
        y = fn["modulated_rms_norm"](x, w, mod[:, 0], mod[:, 1], seg, 1e-6)
        q = fn["qk_norm_rope"](y.view(N, H, D // H), wq, theta.cos(), theta.sin(), 1e-6)
        z = fn["situ"](q.reshape(N, D), y)
        x = fn["gated_residual"](x, z, mod[:, 2], seg)
        return fn["residual"](x, fn["rms_norm"](z, w, 1e-6))

    compiled = torch.compile(chain, backend="aot_eager", fullgraph=True)
    compare(compiled, chain, (x, w, wq, mod), {"x": x, "w": w, "wq": wq, "mod": mod}, 1e-6)


@triton_test
def test_the_triton_kernels_refuse_what_they_cannot_take():
    needs_triton()
    x = torch.randn(4, 8, dtype=torch.float64, device=DEVICE)
    with pytest.raises(TypeError, match="float64 input; the kernels take float32, bfloat16"):
        triton_fn("rms_norm")(x, torch.ones(8, dtype=torch.float64, device=DEVICE), 1e-6)
    y = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"x and y of shapes \(4, 8\) and \(4, 1\)"):
        triton_fn("residual")(y, y[:, :1])
    with pytest.raises(ValueError, match="want \\[N, D\\], \\[B, D\\], \\[N\\]"):
        triton_fn("gated_residual")(y, y, torch.ones(2, 7, device=DEVICE),
                                    torch.zeros(4, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="want \\[N, H, Dh\\], Dh even"):
        triton_fn("qk_norm_rope")(torch.randn(4, 2, 5, device=DEVICE), torch.ones(5, device=DEVICE),
                                  y[:, :2], y[:, :2], 1e-6)


@triton_test
def test_recomputation_leaves_the_triton_ops_alone_and_would_not_change_them():
    """A Triton op's autograd saves only its inputs, so ``memory.apply_recompute`` does not
    wrap it (a second forward would buy nothing); wrapped by hand, it gives the plain
    gradients bit for bit, so either way a run trains the same."""
    needs_triton()
    from kohakumoss.memory import apply_recompute, recomputed
    from kohakumoss.model.build import tiny_transformer

    g = torch.Generator().manual_seed(9)
    x, w = leaf(g, 13, 64, dtype=torch.bfloat16), leaf(g, 64, dtype=torch.bfloat16)
    shift, scale = leaf(g, 2, 64), leaf(g, 2, 64)
    seg = seg_of([6, 7])
    fn = triton_fn("modulated_rms_norm")
    assert KERNELS.backend("modulated_rms_norm", "triton").keeps_inputs_only
    model = tiny_transformer()
    model.ops = build_op_table(DEVICE, torch.float32, {"modulated_rms_norm": "triton"})
    wrapped_ops = apply_recompute(model)
    assert "modulated_rms_norm" not in wrapped_ops and "rms_norm" in wrapped_ops
    assert [b.fn for b in model.ops.modulated_rms_norm.fn.backends] == [fn]  # the choice, unwrapped
    assert model.ops.modulated_rms_norm.keeps_inputs_only
    args = (x, w, shift, scale, seg, 1e-6)
    plain, wrapped = fn(*args), recomputed(fn, 5)(*args)
    assert torch.equal(plain, wrapped)
    go = torch.randn_like(plain)
    for a, b in zip(torch.autograd.grad(plain, [x, w, shift, scale], go),
                    torch.autograd.grad(wrapped, [x, w, shift, scale], go)):
        assert torch.equal(a, b)


@triton_test
def test_a_recomputed_norm_keeps_its_stream_form():
    """A norm chosen as Triton then compile is wrapped by ``apply_recompute`` (compile keeps
    more than its inputs), and the wrap keeps the Triton stream form: each half's x comes
    back through the norm's node, whose kernel sums x's two gradients (no add of autograd's
    own); the gradients are the plain table's."""
    needs_triton()
    from kohakumoss.memory import apply_recompute
    from kohakumoss.model.build import tiny_transformer

    img, text, sigma, layout = _tiny_inputs(torch.float32)
    layout = layout.to(DEVICE)
    runs = []
    for choice, recompute in ((["triton", "compile"], True), ("triton", False)):
        model = tiny_transformer().to(DEVICE)
        model.ops = build_op_table(DEVICE, torch.float32, {"modulated_rms_norm": choice})
        wrapped = apply_recompute(model) if recompute else []
        assert ("modulated_rms_norm" in wrapped) == recompute
        assert callable(model.ops.modulated_rms_norm.form("added"))  # inference's form too
        v = model(img, text, sigma, layout)
        assert "_StreamNormBackward" in _graph(v)
        v.square().mean().backward()
        runs.append((v, [p.grad for p in model.parameters()]))
    (v_a, g_a), (v_b, g_b) = runs
    assert torch.equal(v_a, v_b)
    assert all(rel(a, b) <= 1e-6 for a, b in zip(g_a, g_b) if a is not None)


@triton_test
def test_blocks_an_engine_wraps_run_whole_and_the_rest_chain():
    """Partial checkpointing wraps the first block: it runs whole (the chain's add made
    before it), the others chained; the step's gradients are the unchained run's bit for bit
    (checkpointing's recomputation included)."""
    needs_triton()
    from kohakumoss.memory.checkpointing import apply_checkpointing
    from kohakumoss.model import cast_model
    from kohakumoss.model.build import tiny_transformer

    img, text, sigma, layout = _tiny_inputs(torch.bfloat16)
    layout = layout.to(DEVICE)
    runs = []
    for chain in (False, True):
        model = cast_model(tiny_transformer(), torch.bfloat16).to(DEVICE)
        model.ops = build_op_table(DEVICE, torch.bfloat16, {op: "triton" for op in ELEMENTWISE})
        for name, p in model.named_parameters():
            p.requires_grad_(".proj." in name)
        assert apply_checkpointing(model, "partial", 1) == ["text_embedder.blocks.0", "layers.0"]
        model.chain_adds = chain
        assert model.chained_blocks() == [False] + [chain] * (model.config.depth - 1)
        v = model(img, text, sigma, layout)
        v.float().square().mean().backward()
        runs.append((v, [p.grad for p in model.parameters() if p.grad is not None]))
    (v_a, g_a), (v_b, g_b) = runs
    assert torch.equal(v_a, v_b) and len(g_a) == len(g_b) > 0
    assert all(torch.equal(a, b) for a, b in zip(g_a, g_b))


# ---- the real model's sizes (GPU) ----------------------------------------------------------

BASE = FLAVORS["base"]
REAL_LENGTHS = [64 * 64 + 104, 64 * 64 + 104]  # two 1 MP samples (64 x 64 latent cells) + text


def _real_call(op: str, dtype: torch.dtype, g: torch.Generator):
    """(args, leaves) of one joint-block call of ``op`` at the base model's sizes."""
    N, D, F, H, Dh = sum(REAL_LENGTHS), BASE.dim, BASE.ffn_dim, BASE.heads, BASE.head_dim
    seg = seg_of(REAL_LENGTHS)
    x = leaf(g, N, D, dtype=dtype)
    if op == "rms_norm":
        w = leaf(g, D, dtype=dtype)
        return (x, w, 1e-6), {"x": x, "weight": w}
    if op == "modulated_rms_norm":
        w, mod = leaf(g, D, dtype=dtype), leaf(g, 2, 6, D, scale=0.5)
        return (x, w, mod[:, 0], mod[:, 1], seg, 1e-6), {"x": x, "weight": w, "mod": mod}
    if op == "qk_norm_rope":
        q, w = leaf(g, N, H, Dh, dtype=dtype), leaf(g, Dh, dtype=dtype)
        theta = leaf(g, N, Dh // 2, scale=20.0, grad=False)
        return (q, w, theta.cos(), theta.sin(), 1e-6), {"x": q, "weight": w}
    if op == "situ":
        ug = leaf(g, N, 2 * F, dtype=dtype, scale=3.0)
        return tuple(ug.split(F, dim=-1)), {"ug": ug}
    y = leaf(g, N, D, dtype=dtype, scale=0.1)
    if op == "residual":
        return (x, y), {"x": x, "y": y}
    gate = leaf(g, 2, D, scale=0.5)
    return (x, y, gate, seg), {"x": x, "y": y, "gate": gate}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=_ids)
@pytest.mark.parametrize("op", ELEMENTWISE)
def test_triton_at_the_real_sizes(op, dtype):
    """A joint block's calls for a 2 x 1 MP batch (8400 tokens) of the 5B model."""
    needs_triton()
    args, leaves = _real_call(op, dtype, torch.Generator().manual_seed(12))
    compare(triton_fn(op), ops.REFERENCE[op], args, leaves, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=_ids)
def test_the_norm_that_makes_the_add_at_the_real_sizes(dtype):
    """The ``added`` form at a 2 x 1 MP batch: the stream and its norm against the references'
    add then norm, x and the branch's gradients with the stream read by a later add too."""
    needs_triton()
    g = torch.Generator().manual_seed(15)
    N, D = sum(REAL_LENGTHS), BASE.dim
    seg = seg_of(REAL_LENGTHS)
    x, y = leaf(g, N, D, dtype=dtype), leaf(g, N, D, dtype=dtype, scale=0.1)
    w = leaf(g, D, dtype=dtype, grad=False)
    mod = leaf(g, 2, 6, D, scale=0.5, grad=False)
    form = KERNELS.backend("modulated_rms_norm", "triton").forms["added"]

    def mine(x, y):
        out, s = form(x, w, mod[:, 3], mod[:, 4], seg, 1e-6, y, mod[:, 2])
        return ops.gated_residual(s, out, mod[:, 5], seg)

    def reference(x, y):
        s = ops.gated_residual(x, y, mod[:, 2], seg)
        out = ops.modulated_rms_norm(s, w, mod[:, 3], mod[:, 4], seg, 1e-6)
        return ops.gated_residual(s, out, mod[:, 5], seg)

    compare(mine, reference, (x, y), {"x": x, "y": y}, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=_ids)
@pytest.mark.parametrize("loss", ["mse", "huber"])
def test_the_flow_loss_at_the_real_sizes(loss, dtype):
    """The loss of a 2 x 1 MP batch: 8192 image tokens x 128 channels."""
    needs_triton()
    g = torch.Generator().manual_seed(14)
    N, C = 2 * 4096, BASE.latent_channels
    pred, target = leaf(g, N, C, dtype=dtype), leaf(g, N, C, grad=False)
    weight = torch.tensor([1.0, 0.5], device=DEVICE)
    seg = seg_of([4096, 4096])
    args = (pred, target, seg, weight, N, loss, 1.0)
    out, want = triton_fn("flow_loss")(*args), reference_flow_loss(*args)
    assert rel(out, want) <= 1e-5
    got, = torch.autograd.grad(out, pred)
    exp, = torch.autograd.grad(want, pred)
    assert rel(got, exp) <= TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("backend,dtype", [("flash_varlen", torch.bfloat16),
                                           ("flash_varlen", torch.float16),
                                           ("flex", torch.bfloat16), ("flex", torch.float32),
                                           ("fa4", torch.bfloat16), ("fa4", torch.float16)],
                         ids=lambda v: v if isinstance(v, str) else _ids(v))
def test_attention_at_the_real_sizes(backend, dtype):
    b = KERNELS.backend("varlen_attention", backend)
    if not b.available(DEVICE, dtype):
        pytest.skip(f"{backend} cannot run on {DEVICE} in {dtype}")
    q, k, v = _attention_inputs(REAL_LENGTHS, BASE.heads, BASE.head_dim, dtype, grad=True)
    compare(b.fn, ops.varlen_attention, (q, k, v, REAL_LENGTHS), {"q": q, "k": k, "v": v},
            ATTENTION_TOL[dtype])


# ---- the tiny model with a table of Triton kernels -----------------------------------------

def _tiny_inputs(dtype):
    c = FLAVORS["tiny"]
    layout = build_layout([(3, 4), (2, 5), (1, 1)], [6, 0, 3])
    g = torch.Generator().manual_seed(10)
    img = torch.randn(layout.n_img, c.latent_channels, generator=g).to(DEVICE)
    text = torch.randn(layout.n_txt, c.text_dim, generator=g).to(DEVICE)
    return img, text, torch.tensor([0.9, 0.4, 0.05], device=DEVICE), layout


@triton_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
def test_the_tiny_model_with_triton_kernels_matches_the_reference(dtype):
    """Forward output and every parameter's gradient, with recomputation on as in training."""
    needs_triton()
    from kohakumoss.memory import apply_recompute
    from kohakumoss.model import cast_model
    from kohakumoss.model.build import tiny_transformer

    img, text, sigma, layout = _tiny_inputs(dtype)
    layout = layout.to(DEVICE)
    results = []
    fast = {op: "triton" for op in ELEMENTWISE}
    if CUDA:
        fast["varlen_attention"] = ["flash_varlen", "flex"]
    for choices in ({}, fast):
        model = cast_model(tiny_transformer(), dtype).to(DEVICE)
        model.ops = build_op_table(DEVICE, dtype, choices)
        apply_recompute(model)
        v = model(img, text, sigma, layout)
        v.float().square().mean().backward()
        results.append((v, {n: p.grad for n, p in model.named_parameters()}))
    (v_ref, g_ref), (v_tri, g_tri) = results
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]  # bf16: flips compound over blocks
    assert rel(v_tri, v_ref) <= tol
    for name in g_ref:
        assert rel(g_tri[name], g_ref[name]) <= tol, name


def parity_error(choices) -> float:
    """``kmoss check parity tests/data/vectors``' fp32 relative error with these kernels."""
    from kohakumoss.checks.parity import load_batch, rel_error
    from kohakumoss.formats.model_files import load_transformer

    folder = ROOT / "tests" / "data" / "vectors"
    batch = load_batch(folder)
    layout = build_layout(batch["hw"].tolist(), batch["text_len"].tolist()).to(DEVICE)
    model, _ = load_transformer(folder / "weights_official.safetensors", dtype=torch.float32,
                                device=DEVICE)
    model.ops = build_op_table(DEVICE, torch.float32, choices)
    with torch.no_grad():
        v = model(batch["img"].to(DEVICE), batch["text"].to(DEVICE), batch["sigma"].to(DEVICE),
                  layout)
    return rel_error(v, batch["v_fp32"])


@triton_test
def test_parity_vectors_hold_with_the_triton_table():
    """``kmoss check parity tests/data/vectors``' fp32 comparison, with every Triton op."""
    needs_triton()
    from kohakumoss.checks.parity import TOL as PARITY_TOL

    assert parity_error({op: "triton" for op in ELEMENTWISE}) <= PARITY_TOL[torch.float32]


# ---- attention -----------------------------------------------------------------------------

ATTENTION_SHAPES = {"one": ([1], 2, 32), "odd": ([5, 1, 9], 3, 16), "long": ([70, 33], 2, 64),
                    "empty": ([0, 7, 0], 1, 32)}


def _attention_inputs(lengths, heads, head_dim, dtype, grad, seed=11):
    g = torch.Generator().manual_seed(seed)
    N = sum(lengths)
    return [leaf(g, N, heads, head_dim, dtype=dtype, grad=grad) for _ in range(3)]


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("case", ATTENTION_SHAPES.values(), ids=ATTENTION_SHAPES.keys())
def test_flex_attention_forward(case, dtype):
    """Flex with a document mask, forward (the CPU has no flex backward; the GPU test below
    checks gradients)."""
    lengths, heads, head_dim = case
    if not CUDA and dtype != torch.float32:
        pytest.skip("flex on the CPU: float32 only")
    q, k, v = _attention_inputs(lengths, heads, head_dim, dtype, grad=False)
    fn = KERNELS.backend("varlen_attention", "flex").fn
    with torch.no_grad():
        out, want = fn(q, k, v, lengths), ops.varlen_attention(q, k, v, lengths)
    assert rel(out, want) <= ATTENTION_TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash_varlen", "flex", "fa4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("case", ATTENTION_SHAPES.values(), ids=ATTENTION_SHAPES.keys())
def test_attention_forward_and_gradients(case, dtype, backend):
    lengths, heads, head_dim = case
    b = KERNELS.backend("varlen_attention", backend)
    if not b.available(DEVICE, dtype):
        pytest.skip(f"{backend} cannot run on {DEVICE} in {dtype}")
    if not b.takes({"Dh": head_dim}):
        pytest.skip(f"{backend} does not take head dim {head_dim} (the reference runs instead)")
    q, k, v = _attention_inputs(lengths, heads, head_dim, dtype, grad=True)
    if max(lengths) > 1:
        compare(b.fn, ops.varlen_attention, (q, k, v, lengths), {"q": q, "k": k, "v": v},
                ATTENTION_TOL[dtype])
        return
    # one key per segment: the output is v, dv is dO, and dq = dk = 0 up to rounding (each
    # side's rounding noise, so no relative error between them means anything)
    out = b.fn(q, k, v, lengths)
    assert rel(out, v) <= ATTENTION_TOL[dtype]
    grad_out = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, [q, k, v], grad_out)
    assert rel(dv, grad_out) <= ATTENTION_TOL[dtype]
    assert dq.float().norm() <= 1e-2 * dv.float().norm() and dk.float().norm() <= 1e-2 * dv.float().norm()


def test_attention_backends_refuse_bad_segments():
    q = torch.randn(5, 2, 16)
    for backend in ("flash_varlen", "flex", "fa4"):
        with pytest.raises(ValueError, match="segment lengths sum to 4"):
            KERNELS.backend("varlen_attention", backend).fn(q, q, q, [3, 1])


# ---- registration and availability ---------------------------------------------------------

def test_every_backend_is_registered_and_says_where_it_runs():
    for op in ELEMENTWISE:
        assert "triton" in KERNELS.names(op)
        available = KERNELS.backend(op, "triton").available
        assert not available(torch.device("cpu"), torch.float64)
        assert available(torch.device("cpu"), torch.float32) == (COMMON is not None and INTERPRETED)
        if COMMON is not None and not INTERPRETED:
            sm80 = CUDA and torch.cuda.get_device_capability() >= (8, 0)
            assert available(DEVICE, torch.bfloat16) == sm80
    assert {"flash_varlen", "flex", "fa4"} <= set(KERNELS.names("varlen_attention"))
    for name in ("flash_varlen", "fa4"):
        available = KERNELS.backend("varlen_attention", name).available
        assert not available(torch.device("cpu"), torch.bfloat16)
        if CUDA:
            assert not available(DEVICE, torch.float32)  # 16-bit only
    table = build_op_table("cpu", torch.float64, {op: "triton" for op in ELEMENTWISE})
    assert all(getattr(table, op).fn is ops.REFERENCE[op] for op in ELEMENTWISE)


def test_kohakumoss_imports_and_reports_triton_unavailable_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"  # 'import triton' raises ImportError
            "import torch\n"
            "from kohakumoss.kernels import KERNELS, backends, build_op_table\n"
            "b = KERNELS.backend('situ', 'triton')\n"
            "assert not b.available(torch.device('cpu'), torch.float32)\n"
            "assert not b.available(torch.device('cuda'), torch.bfloat16)\n"
            "t = build_op_table('cpu', torch.float32, {'situ': 'triton'})\n"
            "assert t.situ is not b.fn\n"
            "print(backends.triton_unavailable_reason('situ'))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ImportError" in done.stdout or "ModuleNotFoundError" in done.stdout


# ---- the interpreted suite on a CPU machine ------------------------------------------------

def test_the_interpreted_suite():
    """Reruns this file with ``TRITON_INTERPRET=1`` set before anything imports Triton."""
    run_interpreted(Path(__file__), TRITON_TESTS)


def run_interpreted(path: Path, names: list[str]) -> None:
    """Run the tests ``names`` of the file ``path`` in a subprocess with ``TRITON_INTERPRET=1``
    set before anything imports Triton; they must pass. Skips where they ran in this process
    (a CUDA machine, or interpreted already) and where Triton is not installed."""
    if CUDA or INTERPRETED:
        pytest.skip("the Triton tests ran in this process")
    if COMMON is None:
        pytest.skip(f"triton is not installed here ({backends.triton_unavailable_reason('situ')})")
    env = dict(os.environ, TRITON_INTERPRET="1")
    here = path.relative_to(ROOT)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                           "-m", "not gpu", *[f"{here}::{name}" for name in names]],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
