"""The quantized base's kernels (``kohakumoss/quant/triton_quant.py``, ``triton_fp8.py``,
``fp8_compute.py``) against their references (``quant/ops.py``: ``quant_linear``, ``fp8_linear``, ``fp8_rows``):
the forward and every input gradient, over shapes (one row, odd sizes, leading dimensions),
dtypes, int8 and fp8 codes, with and without a bias.

As in ``test_kernel_backends.py``: on a CPU machine the Triton tests run interpreted, in a
subprocess started with ``TRITON_INTERPRET=1`` (``test_the_interpreted_suite``); on a CUDA
machine compiled, and the ``gpu`` tests add the real model's sizes and the fp8 GEMMs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kohakumoss.quant import ops as quant_ops
from kohakumoss.kernels import KERNELS
from kohakumoss.model import ops
from kohakumoss.quant.linear import quantize_rows

from test_kernel_backends import CUDA, DEVICE, TOL, _ids, compare, leaf, needs_triton, rel, run_interpreted

TRITON_TESTS: list[str] = []
SHAPES = [(1, 32, 16), (37, 48, 40)]  # (rows, in, out): one row; odd sizes over 3 x 3 tiles, 3 steps of the sum


def triton_test(fn):
    TRITON_TESTS.append(fn.__name__)
    return fn


def weights(g: torch.Generator, n: int, k: int, base: str) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scale = quantize_rows(torch.randn(n, k, generator=g) * 0.05, base)
    return codes.to(DEVICE), scale.to(DEVICE)


@triton_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=_ids)
@pytest.mark.parametrize("base", ["int8", "fp8"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("backend", ["triton", "dequant_mm"])
def test_quant_linear(backend, shape, base, dtype):
    """The fused kernel applies each row's scale after the sum (one rounding); the reference
    and ``dequant_mm`` round the dequantized weight to the activation dtype first: equal in
    fp32, within the dtype's tolerance otherwise."""
    needs_triton()
    g = torch.Generator().manual_seed(0)
    M, K, N = shape
    codes, scale = weights(g, N, K, base)
    x = leaf(g, M, K, dtype=dtype)
    fn = KERNELS.backend("quant_linear", backend).fn
    compare(fn, quant_ops.quant_linear, (x, codes, scale, None), {"x": x}, TOL[dtype])
    b = leaf(g, N, dtype=dtype, scale=0.1)  # a bias that trains: its gradient too
    compare(fn, quant_ops.quant_linear, (x, codes, scale, b), {"x": x, "bias": b}, TOL[dtype])
    x3 = leaf(g, 2, M, K, dtype=dtype)  # leading dimensions
    compare(fn, quant_ops.quant_linear, (x3, codes, scale, None), {"x": x3}, TOL[dtype])


@triton_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
def test_fp8_rows(dtype):
    """Row-wise e4m3 codes and scales of activations, as the reference rounds them."""
    needs_triton()
    g = torch.Generator().manual_seed(1)
    x = leaf(g, 37, 80, dtype=dtype, grad=False) * 3
    x[5] = 0  # a zero row: scale 1, zero codes
    tq = pytest.importorskip("kohakumoss.quant.triton_fp8")
    codes, scale = tq.fp8_rows(x)
    want_codes, want_scale = quant_ops.fp8_rows(x)
    assert torch.equal(scale, want_scale) and scale[5] == 1
    assert torch.equal(codes.float(), want_codes.float())
    # with a factor per column (fp8 compute's input gradient: dy times the weight's row
    # scales), the product taken in fp32 before the row's amax
    cols = (torch.rand(80, generator=g) * 0.02 + 1e-3).to(DEVICE)
    codes, scale = tq.fp8_rows(x, cols)
    want_codes, want_scale = quant_ops.fp8_rows(x, cols)
    assert torch.equal(scale, want_scale) and not torch.equal(scale, quant_ops.fp8_rows(x)[1])
    assert torch.equal(codes.float(), want_codes.float())


@triton_test
@pytest.mark.parametrize("launch", [(16, 1, 1, 4), (64, 1, 1, 4), (16, 4, 2, 4), (64, 3, 1, 8), (64, 5, 2, 4)],
                         ids=["two-pass", "held", "two-pass-4-rows-2-stages", "held-3-rows", "held-5-rows-2-stages"])
def test_fp8_rows_launches_give_the_same_codes(launch):
    """Every launch of the row quantization (``bench/bench_fp8_rows.py`` sweeps them): the
    row held in registers or read twice, several rows a program (13 rows: the last program's
    run past the end), walked in stages. The codes and scales are the default launch's
    (``test_fp8_lora_kernels`` holds that one to the reference): three sources with column
    factors, one without, each with a LoRA tail."""
    needs_triton()
    t8 = pytest.importorskip("kohakumoss.quant.triton_fp8")
    g = torch.Generator().manual_seed(12)
    for n, K, cols in ((3, 24, True), (1, 40, False)):
        xs = [leaf(g, 13, K, dtype=torch.bfloat16, grad=False) * 2 for _ in range(n)]
        cs = (torch.rand(n * K, generator=g) + 0.5).to(DEVICE) if cols else None
        h, amax = leaf(g, 13, 5, dtype=torch.bfloat16, grad=False), (torch.rand(5, generator=g) * 3).to(DEVICE)
        want = t8.fp8_rows_joined(xs, cs, (h, amax))
        got = t8.fp8_rows_joined(xs, cs, (h, amax), launch=launch)
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])


@triton_test
@pytest.mark.parametrize("base", ["int8", "fp8"])
def test_dequantize_rounds_as_the_reference(base):
    needs_triton()
    tq = pytest.importorskip("kohakumoss.quant.triton_quant")
    codes, scale = weights(torch.Generator().manual_seed(6), 37, 80, base)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(tq.dequantize(codes, scale, dtype), quant_ops.dequantize_rows(codes, scale, dtype))


@triton_test
def test_fp8_codes_read_as_bytes_give_the_same_results(monkeypatch):
    """Below sm89 the kernels take e4m3 codes as bytes and decode them (``E4M3_BYTES``): every
    finite byte gives torch's own value, and the fused kernel's forward and input gradient and
    ``dequantize`` are those of the e4m3 path bit for bit."""
    needs_triton()
    tq = pytest.importorskip("kohakumoss.quant.triton_quant")
    every = torch.arange(256, dtype=torch.uint8)
    every = every[(every & 0x7F) != 0x7F].view(torch.float8_e4m3fn).reshape(2, 127)  # no NaN
    ones = torch.ones(2, device=DEVICE)
    monkeypatch.setattr(tq, "E4M3_BYTES", True)
    decoded = tq.dequantize(every.to(DEVICE), ones, torch.float32)
    assert torch.equal(decoded.cpu(), every.float())  # -0.0 and the subnormals included
    assert torch.equal(decoded.cpu().signbit(), every.float().signbit())
    g = torch.Generator().manual_seed(8)
    codes, scale = weights(g, 40, 48, "fp8")
    x = leaf(g, 37, 48, dtype=torch.bfloat16)
    got = {}
    for as_bytes in (True, False) if tq.native_e4m3(torch.device(DEVICE)) else (True,):
        monkeypatch.setattr(tq, "E4M3_BYTES", as_bytes)
        xi = x.detach().clone().requires_grad_()
        y = tq.quant_linear(xi, codes, scale, None)
        y.backward(torch.ones_like(y))
        got[as_bytes] = (y, xi.grad, tq.dequantize(codes, scale, torch.bfloat16))
    if False not in got:  # a card without e4m3 in Triton: the reference's dequantized weight
        assert torch.equal(got[True][2], quant_ops.dequantize_rows(codes, scale, torch.bfloat16))
        return
    for a, b in zip(got[True], got[False]):
        assert torch.equal(a, b)


@triton_test
def test_many_rows_take_dequant_mm_and_few_the_fused_kernel():
    """The default choice of a quantized base (``quant.plan.DEFAULT_BACKENDS``)."""
    needs_triton()
    from kohakumoss.quant.backends import DEQUANT_ROWS
    from kohakumoss.quant.plan import DEFAULT_BACKENDS

    op = KERNELS.chosen_op("quant_linear", DEVICE, torch.float32, list(DEFAULT_BACKENDS["quant_linear"]))
    codes, scale = weights(torch.Generator().manual_seed(7), 16, 32, "int8")
    many, few = torch.zeros(DEQUANT_ROWS, 32), torch.zeros(DEQUANT_ROWS - 1, 32)
    assert op.backend_for(many, codes, scale, None) == "dequant_mm"
    assert op.backend_for(few, codes, scale, None) == "triton"


@triton_test
def test_the_quant_ops_pass_opcheck():
    """Schema, fake (meta) implementations and autograd registration of the custom ops."""
    needs_triton()
    tq = pytest.importorskip("kohakumoss.quant.triton_quant")
    g = torch.Generator().manual_seed(2)
    codes, scale = weights(g, 40, 48, "int8")
    x = leaf(g, 37, 48, dtype=torch.float32)
    torch.library.opcheck(tq._fwd_op, (x, codes, scale, None))
    torch.library.opcheck(tq._bwd_op, (leaf(g, 37, 40, grad=False), codes, scale))


@triton_test
def test_the_quant_kernel_refuses_what_it_cannot_take():
    needs_triton()
    fn = KERNELS.backend("quant_linear", "triton").fn
    g = torch.Generator().manual_seed(3)
    codes, scale = weights(g, 16, 32, "int8")
    with pytest.raises(ValueError, match="x's last size = K"):
        fn(leaf(g, 4, 16), codes, scale, None)
    with pytest.raises(ValueError, match="float32 \\[N\\]"):
        fn(leaf(g, 4, 32), codes, scale.half(), None)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn"):
        fn(leaf(g, 4, 32), codes.float(), scale, None)


@triton_test
def test_fp8_lora_kernels():
    """The kernels of a LoRA inside the fp8 GEMM against ``ops``: the column factors and the
    widened codes byte for byte (the codes, the slot at its offset, zeros elsewhere), and the
    row ``[x | h g]`` (zero columns padding it to a multiple of 16) value for value, over rows
    held in registers and wider ones, a rank that is not a multiple of 16 and a zero column."""
    needs_triton()
    tq = pytest.importorskip("kohakumoss.quant.triton_fp8")
    g = torch.Generator().manual_seed(13)
    codes, scale = weights(g, 40, 48, "fp8")
    up = leaf(g, 40, 5, dtype=torch.bfloat16, scale=0.1, grad=False)
    up[:, 2] = 0
    first = leaf(g, 40, 3, dtype=torch.bfloat16, grad=False)  # another LoRA of the node, first
    amax = tq.lora_amax([first, up], [scale, scale])  # 40 rows: three programs interpreted, one launch
    want_g, want_slot = quant_ops.fp8_lora_slots(up, scale)
    assert torch.equal(amax / 448, torch.cat([quant_ops.fp8_lora_slots(first, scale)[0], want_g]))
    assert tq.slot_width(5) == 16 and tq.slot_width(32) == 32 and tq.slot_width(96) == 96
    wide = tq.widened_codes(codes, up, scale, amax, 3, 16)
    assert wide.shape == (40, 64) and wide.dtype == torch.float8_e4m3fn
    b = wide.view(torch.uint8)
    assert torch.equal(b[:, :48], codes.view(torch.uint8))
    assert torch.equal(b[:, 51:56], want_slot.view(torch.uint8))
    assert not b[:, 48:51].any() and not b[:, 56:].any()
    h = leaf(g, 37, 8, dtype=torch.bfloat16, grad=False)
    for K in (24, 40):  # rows held in registers (read once); wider rows, two passes
        x = leaf(g, 37, K, dtype=torch.bfloat16, grad=False)
        q, s = tq.fp8_rows_joined([x], None, (h, amax))
        want_q, want_s = quant_ops.fp8_rows(torch.cat([x.float(), h.float() * (amax / 448)], dim=1))
        assert q.shape == (37, K + 16) and torch.equal(s, want_s)
        assert torch.equal(q[:, :K + 8].float(), want_q.float())  # -0 and 0 alike
        assert not q[:, K + 8:].float().any()
    with pytest.raises(ValueError, match="columns 12..17 of 16"):
        tq.widened_codes(codes, up, scale, amax, 12, 16)
    # a slot wider than one block of columns (64), this LoRA's straddling two
    wide_amax = torch.cat([(torch.rand(62, generator=g) + 0.5).to(DEVICE), amax[3:]])
    b = tq.widened_codes(codes, up, scale, wide_amax, 62, 80).view(torch.uint8)
    assert b.shape == (40, 128) and torch.equal(b[:, :48], codes.view(torch.uint8))
    assert torch.equal(b[:, 110:115], want_slot.view(torch.uint8))
    assert not b[:, 48:110].any() and not b[:, 115:].any()
    # the input gradient's: down^T [K, R] (a transposed view) as columns beside the codes'
    # transposes, no row scales, and the gradient rows joined with their column factors
    down = leaf(g, 5, 48, dtype=torch.bfloat16, grad=False)
    damax = torch.linalg.vector_norm(down, float("inf"), dim=1, dtype=torch.float32)  # the backward's
    want_gd, want_qd = quant_ops.fp8_lora_slots(down.t(), torch.ones(48, device=DEVICE))
    assert torch.equal(damax / 448, want_gd)
    ct = tq.transposed_codes([codes, codes], (down, damax)).view(torch.uint8)
    assert ct.shape == (48, 96) and torch.equal(ct[:, :40], codes.t().view(torch.uint8))
    assert torch.equal(ct[:, 80:85], want_qd.view(torch.uint8)) and not ct[:, 85:].any()
    dys = [leaf(g, 37, 40, dtype=torch.bfloat16, grad=False) for _ in range(2)]
    cols = (torch.rand(80, generator=g) * 0.02 + 1e-3).to(DEVICE)
    t = leaf(g, 37, 5, dtype=torch.bfloat16, grad=False)
    q, s = tq.fp8_rows_joined(dys, cols, (t, damax))
    want_q, want_s = quant_ops.fp8_rows(torch.cat([torch.cat(dys, 1).float() * cols, t.float() * want_gd], 1))
    assert q.shape == (37, 96) and torch.equal(s, want_s)
    assert torch.equal(q[:, :85].float(), want_q.float()) and not q[:, 85:].float().any()


def _held(codes: torch.Tensor, width: int) -> torch.Tensor:
    """``codes`` as ``QuantizedLinear.hold_slots`` holds them: the first columns of a wider
    buffer, ``width`` columns after each row (here not zero: whatever was there stays)."""
    N, K = codes.shape
    wide = torch.full((N, K + width), 0x5A, dtype=torch.uint8, device=codes.device)
    wide[:, :K].copy_(codes.view(torch.uint8))
    return wide.view(codes.dtype)[:, :K]


@triton_test
def test_codes_held_beside_their_slot_are_filled_in_place():
    """Codes held with their slot columns after them (``slot_view``) take the slot in place
    (``filled_slots``): the same bytes as ``widened_codes``' copy, the codes untouched; codes
    held for another width, or not held, are not taken for it; and their transposes read the
    held rows in place, the same bytes as the plain codes'."""
    needs_triton()
    tq = pytest.importorskip("kohakumoss.quant.triton_fp8")
    g = torch.Generator().manual_seed(15)
    codes, scale = weights(g, 40, 48, "fp8")
    up = leaf(g, 40, 5, dtype=torch.bfloat16, scale=0.1, grad=False)
    amax = tq.lora_amax([leaf(g, 40, 3, dtype=torch.bfloat16, grad=False), up], [scale, scale])
    held = _held(codes, 16)
    assert tq.slot_view(codes, 16) is None and tq.slot_view(held, 32) is None
    wide = tq.slot_view(held, 16)
    assert wide.shape == (40, 64) and wide.data_ptr() == held.data_ptr()
    got = tq.filled_slots(wide, up, scale, amax, 3, 16)
    want = tq.widened_codes(codes, up, scale, amax, 3, 16)
    assert got.data_ptr() == held.data_ptr()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(held.view(torch.uint8), codes.view(torch.uint8))
    down = leaf(g, 5, 48, dtype=torch.bfloat16, grad=False)
    damax = torch.linalg.vector_norm(down, float("inf"), dim=1, dtype=torch.float32)
    assert torch.equal(tq.transposed_codes([held, codes], (down, damax)).view(torch.uint8),
                       tq.transposed_codes([codes, codes], (down, damax)).view(torch.uint8))


def _held_matches_plain(x, layers, held, kept) -> None:
    """The ``full`` node over ``held`` codes with ``kept`` transposes (twice: the second forward
    and backward overwrite their own slots) against the node over plain ``layers``, outputs
    and every gradient bit for bit; then the first linear alone (``fp8_linear``, a held layer
    without its LoRA: the codes' rows K + slot apart), both input-gradient paths."""
    fn = KERNELS.backend("fp8_lora_linears", "scaled_mm").fn
    leaves = [x, *(t for _, _, d, u in layers for t in (d, u))]
    M, N = x.shape[0], layers[0][0].shape[0]
    dy = [torch.randn(M, N, generator=torch.Generator().manual_seed(i)).to(DEVICE, torch.bfloat16)
          for i in range(len(layers))]
    runs = []
    for ls, held_t in ((layers, None), (held, kept), (held, kept)):
        ys = fn(x, ls, True, held_t=held_t)
        runs.append([y.detach() for y in ys] + list(torch.autograd.grad(ys, leaves, dy)))
    for a, b, c in zip(*runs):
        assert torch.equal(a, b) and torch.equal(a, c)
    lin = KERNELS.backend("fp8_linear", "scaled_mm").fn
    for grad_fp8 in (False, True):
        got = [lin(x, c, s, None, grad_fp8) for c, s in ((layers[0][0], layers[0][1]), (held[0][0], held[0][1]))]
        assert torch.equal(got[0], got[1])
        assert torch.equal(*(torch.autograd.grad(y, x, dy[0])[0] for y in got))


@triton_test
@pytest.mark.parametrize("n", [1, 3])
def test_fp8_lora_linears_over_held_codes_are_bit_identical(n):
    """With ``full``, codes held beside their slot, and their transposes kept between steps
    (``held_t``: only the slot written in backward), give the node's outputs and every
    gradient bit for bit as codes held plainly."""
    needs_triton()
    tq = pytest.importorskip("kohakumoss.quant.triton_fp8")
    x, layers = fp8_loras(torch.Generator().manual_seed(16), n, 37, 48, 32, 4)
    width = tq.slot_width(4 * n)
    held = [(_held(c, width), s, d, u) for c, s, d, u in layers]
    assert tq.slot_view(held[0][0], width) is not None
    kept = torch.full((48, 32 * n + width), 0x5A, dtype=torch.uint8, device=DEVICE)  # a stale slot
    kept[:, :32 * n] = torch.cat([c.view(torch.uint8).t() for c, _, _, _ in layers], 1)
    kept = kept.view(torch.float8_e4m3fn)
    _held_matches_plain(x, layers, held, kept)
    assert torch.equal(kept.view(torch.uint8)[:, :32 * n],
                       torch.cat([c.view(torch.uint8).t() for c, _, _, _ in layers], 1))
    with pytest.raises(ValueError, match="held"):
        tq.transposed_codes([c for c, _, _, _ in layers], None, kept)


@triton_test
def test_fp8_rows_joined_and_transposed_codes():
    """Quantizing several sources as one row equals quantizing their concatenation; the codes'
    transposes side by side equal torch's, byte for byte."""
    needs_triton()
    tq = pytest.importorskip("kohakumoss.quant.triton_fp8")
    g = torch.Generator().manual_seed(8)
    for K in (24, 40):  # rows held in registers (read once); wider rows, two passes
        xs = [leaf(g, 37, K, dtype=torch.bfloat16, grad=False) * (i + 1) for i in range(3)]
        cols = (torch.rand(3 * K, generator=g) + 0.5).to(DEVICE)
        for n in (1, 2, 3):
            joined = torch.cat(xs[:n], dim=1)
            for cs in (None, cols[:K * n]):
                codes, scale = tq.fp8_rows_joined(xs[:n], cs)
                want_codes, want_scale = quant_ops.fp8_rows(joined, cs)
                assert torch.equal(scale, want_scale)
                assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    strided = torch.cat(xs, dim=1)[:, 40:80]  # a source whose rows are 120 apart
    assert torch.equal(tq.fp8_rows_joined([strided])[0].view(torch.uint8),
                       quant_ops.fp8_rows(strided)[0].view(torch.uint8))
    codes = [weights(g, n, 40, "fp8")[0] for n in (24, 24, 8)]
    got = tq.transposed_codes(codes)
    want = torch.cat([c.t() for c in codes], dim=1)
    assert got.shape == (40, 56) and got.is_contiguous()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(ValueError, match="one to three"):
        tq.fp8_rows_joined(xs + xs[:1])


def fp8_loras(g: torch.Generator, n: int, M: int, K: int, N: int, r: int):
    """x [M, K] and ``n`` (codes, scale, down, up) of width N and rank r, bf16 leaves."""
    x = leaf(g, M, K, dtype=torch.bfloat16)
    layers = []
    for _ in range(n):
        codes, scale = weights(g, N, K, "fp8")
        layers.append((codes, scale, leaf(g, r, K, dtype=torch.bfloat16, scale=0.1),
                       leaf(g, N, r, dtype=torch.bfloat16, scale=0.1)))
    return x, layers


def _joined(fn):
    return lambda x, layers, full: torch.cat(fn(x, layers, full), dim=-1)


@triton_test
@pytest.mark.parametrize("full", [False, True], ids=["on", "full"])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("backend", ["scaled_mm", "scaled_mm_fast"])
def test_fp8_lora_linears_match_their_reference(backend, n, full):
    """fp8 linears with their LoRAs as one node (``scaled_mm``: ``torch._scaled_mm``, which
    the CPU has too, and the Triton quantization; ``scaled_mm_fast``: its input gradient's
    GEMM accumulating fast) against ``quant_ops.fp8_lora_linears``: output, input gradient and
    every LoRA gradient; with ``full`` the joined fp8 input gradient."""
    needs_triton()
    g = torch.Generator().manual_seed(9)
    x, layers = fp8_loras(g, n, 37, 48, 32, 4)
    leaves = {"x": x, **{f"{w}{i}": t for i, (_, _, d, u) in enumerate(layers)
                         for w, t in (("down", d), ("up", u))}}
    fn = KERNELS.backend("fp8_lora_linears", backend).fn
    compare(_joined(fn), _joined(quant_ops.fp8_lora_linears), (x, layers, full), leaves, TOL[torch.bfloat16])
    x3 = leaf(g, 2, 5, 48, dtype=torch.bfloat16)  # leading dimensions
    compare(_joined(fn), _joined(quant_ops.fp8_lora_linears), (x3, layers, full), {"x": x3}, TOL[torch.bfloat16])


@triton_test
@pytest.mark.parametrize("op", ["fp8_linear", "fp8_lora_linears"])
def test_fast_accumulation_reaches_only_the_fast_backends_gradients(op, monkeypatch):
    """Every fp8 GEMM of a forward accumulates fast; the input gradient's GEMM (``full``)
    does so only in the ``scaled_mm_fast`` backends, ``scaled_mm`` promotes its sums: the
    ``use_fast_accum`` each ``torch._scaled_mm`` call is given, forward then backward."""
    needs_triton()
    calls: list[bool] = []
    real = torch._scaled_mm

    def scaled_mm(*args, use_fast_accum=False, **kw):
        calls.append(use_fast_accum)
        return real(*args, use_fast_accum=use_fast_accum, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    g = torch.Generator().manual_seed(19)
    x, layers = fp8_loras(g, 2, 37, 48, 32, 4)
    for backend, fast in (("scaled_mm", False), ("scaled_mm_fast", True)):
        calls.clear()
        fn = KERNELS.backend(op, backend).fn
        ys = fn(x, layers, True) if op == "fp8_lora_linears" else [fn(x, *layers[0][:2], None, True)]
        forward = len(calls)
        torch.autograd.grad(ys, [x], [torch.ones_like(y) for y in ys])
        assert calls[:forward] == [True] * forward and forward == len(ys)
        assert calls[forward:] == [fast]  # one input-gradient GEMM over every linear


def _on_grid(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``t``'s shape filled with multiples of 1/4 in [-0.5, 0.5]: the narrow products of such
    factors are exact in any order of their sums, and in bf16."""
    v = (torch.randint(-2, 3, t.shape, generator=g) / 4).to(t.dtype).to(DEVICE)
    return v.requires_grad_(t.requires_grad)


def test_fp8_lora_linears_reference_is_the_separate_ops():
    """The reference equals ``fp8_linear`` plus the LoRA's two products, forward and every
    gradient, in float32 (one linear: its joined quantization is the linear's own). With
    ``full`` the LoRA's products are summed in e4m3 inside the fp8 products: without a LoRA
    delta (up = 0) the output is ``fp8_linear``'s bit for bit, with one it and the input
    gradient (``t down`` inside its fp8 product) are within e4m3's rounding of the separate
    ops', and the LoRA's gradients are theirs (straight through)."""
    g = torch.Generator().manual_seed(10)
    x = torch.randn(9, 48, generator=g, dtype=torch.float64).float().requires_grad_()
    codes, scale = quantize_rows(torch.randn(32, 48, generator=g) * 0.05, "fp8")
    down = (torch.randn(4, 48, generator=g) * 0.1).requires_grad_()
    up = (torch.randn(32, 4, generator=g) * 0.1).requires_grad_()
    dy = torch.randn(9, 32, generator=g)
    for full in (False, True):
        got = quant_ops.fp8_lora_linears(x, [(codes, scale, down, up)], full)[0]
        want = quant_ops.fp8_linear(x, codes, scale, None, full) + (x @ down.t()) @ up.t()
        assert 0 < rel(got, want) < 3e-2 if full else rel(got, want) < 1e-6
        ga = torch.autograd.grad(got, (x, down, up), dy)
        gb = torch.autograd.grad(want, (x, down, up), dy)
        assert 0 < rel(ga[0], gb[0]) < 3e-2 if full else rel(ga[0], gb[0]) < 1e-6
        assert rel(ga[1], gb[1]) < 1e-6 and rel(ga[2], gb[2]) < 1e-6
    zero = torch.zeros_like(up)
    assert torch.equal(quant_ops.fp8_lora_linears(x, [(codes, scale, down, zero)], True)[0],
                       quant_ops.fp8_linear(x, codes, scale, None, True))


def test_fp8_lora_slots():
    """The up matrix's slot columns: each column's largest code is e4m3's 448, and under the
    row scales the codes times g give back ``up`` within e4m3's rounding; a zero column has
    g = 0 and zero codes."""
    g = torch.Generator().manual_seed(12)
    codes, scale = quantize_rows(torch.randn(40, 48, generator=g) * 0.05, "fp8")
    up = torch.randn(40, 5, generator=g) * 0.1
    up[:, 3] = 0
    gs, q = quant_ops.fp8_lora_slots(up, scale)
    assert q.dtype == torch.float8_e4m3fn and q.shape == up.shape
    assert gs[3] == 0 and not q[:, 3].float().any()
    assert torch.equal(q.float().abs().amax(0)[[0, 1, 2, 4]], torch.full((4,), 448.0))
    back = q.float() * scale[:, None] * gs
    assert rel(back, up) < 2 ** -4


# ---- the GPU: the real model's sizes and the fp8 GEMMs -------------------------------------

REAL = [(8400, 3072, 3072), (8400, 3072, 16384), (8400, 8192, 3072), (300, 3072, 3072)]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "dequant_mm"])
@pytest.mark.parametrize("base", ["int8", "fp8"])
@pytest.mark.parametrize("shape", REAL, ids=str)
def test_quant_linear_at_the_real_sizes(shape, base, backend):
    if not CUDA:
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(4)
    M, K, N = shape
    codes, scale = weights(g, N, K, base)
    x = leaf(g, M, K, dtype=torch.bfloat16)
    compare(KERNELS.backend("quant_linear", backend).fn, quant_ops.quant_linear, (x, codes, scale, None),
            {"x": x}, TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("full", [False, True], ids=["on", "full"])
@pytest.mark.parametrize("shape", [(37, 48, 32), *REAL], ids=str)
@pytest.mark.parametrize("backend", ["scaled_mm", "scaled_mm_fast"])
def test_fp8_compute_matches_its_reference(backend, shape, full):
    """``torch._scaled_mm`` with row-wise scales against the emulated fp8 product: the same
    codes, exact products, fp32 sums in another order. ``on``: the input gradient is the
    bf16 path; ``full`` (``precision.fp8_compute: full``): a second fp8 GEMM, ``(dy *
    scale)`` quantized per row times the transposed codes, within e4m3's rounding of it;
    ``scaled_mm_fast``: that GEMM accumulating fast, within the same bound."""
    if not CUDA or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs CUDA sm89+")
    g = torch.Generator().manual_seed(5)
    M, K, N = shape
    codes, scale = weights(g, N, K, "fp8")
    x = leaf(g, M, K, dtype=torch.bfloat16)
    fn = KERNELS.backend("fp8_linear", backend).fn
    compare(fn, quant_ops.fp8_linear, (x, codes, scale, None, full), {"x": x}, TOL[torch.bfloat16])
    if not full:  # near the bf16 linear of the dequantized weight: ~2^-4 per activation
        want = quant_ops.quant_linear(x.detach(), codes, scale, None)
        assert rel(fn(x.detach(), codes, scale, None), want) < 6e-2
        return
    dy = torch.randn(M, N, generator=g).to(DEVICE, torch.bfloat16)
    grads = {}
    for fp8_grad in (False, True):
        xi = x.detach().requires_grad_()
        fn(xi, codes, scale, None, fp8_grad).backward(dy)
        grads[fp8_grad] = xi.grad.float()
    assert 0 < rel(grads[True], grads[False]) < 6e-2


@pytest.mark.gpu
@pytest.mark.parametrize("full", [False, True], ids=["on", "full"])
@pytest.mark.parametrize("shape", REAL, ids=str)
@pytest.mark.parametrize("backend", ["scaled_mm", "scaled_mm_fast"])
def test_fp8_lora_linears_at_the_real_sizes(backend, shape, full):
    """The one-node fp8 linears with rank-32 LoRAs at the model's sizes (q, k and v three at
    once) against the reference, with and without fast accumulation in the input gradient."""
    if not CUDA or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs CUDA sm89+")
    M, K, N = shape
    n = 3 if K == N == 3072 else 1
    x, layers = fp8_loras(torch.Generator().manual_seed(11), n, M, K, N, 32)
    fn = KERNELS.backend("fp8_lora_linears", backend).fn
    leaves = {"x": x, "down0": layers[0][2], "up0": layers[0][3]}
    compare(_joined(fn), _joined(quant_ops.fp8_lora_linears), (x, layers, full), leaves, TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("K", [3072, 8192, 16384, 20000], ids=str)
def test_fp8_rows_at_the_real_widths(K):
    """The row quantization at the widths the model's GEMMs take (rows held in registers up
    to 16384, two passes past it), with the LoRA's slot columns, as the reference rounds."""
    if not CUDA:
        pytest.skip("needs CUDA")
    tq = pytest.importorskip("kohakumoss.quant.triton_fp8")
    g = torch.Generator().manual_seed(14)
    x = leaf(g, 300, K, dtype=torch.bfloat16, grad=False)
    codes, scale = tq.fp8_rows(x)
    want_codes, want_scale = quant_ops.fp8_rows(x)
    assert torch.equal(scale, want_scale) and torch.equal(codes.float(), want_codes.float())
    h = leaf(g, 300, 96, dtype=torch.bfloat16, grad=False) * 4
    amax = (torch.rand(96, generator=g) * 2).to(DEVICE)
    codes, scale = tq.fp8_rows_joined([x], None, (h, amax))
    want_codes, want_scale = quant_ops.fp8_rows(torch.cat([x.float(), h.float() * (amax / 448)], dim=1))
    assert torch.equal(scale, want_scale) and torch.equal(codes.float(), want_codes.float())


@pytest.mark.gpu
def test_held_codes_and_kept_transposes_at_the_real_sizes():
    """q, k and v at the model's sizes (rank 32) over codes held beside their slot and
    transposes kept between steps: bit for bit the node over plain codes, twice."""
    if not CUDA or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs CUDA sm89+")
    tq = pytest.importorskip("kohakumoss.quant.triton_fp8")
    x, layers = fp8_loras(torch.Generator().manual_seed(21), 3, 4200, 3072, 3072, 32)
    held = [(_held(c, 96), s, d, u) for c, s, d, u in layers]
    kept = torch.zeros((3072, 3 * 3072 + 96), dtype=torch.uint8, device=DEVICE)
    kept[:, :3 * 3072] = tq.transposed_codes([c for c, _, _, _ in layers]).view(torch.uint8)
    kept = kept.view(torch.float8_e4m3fn)
    _held_matches_plain(x, layers, held, kept)


# ---- the interpreted suite on a CPU machine ------------------------------------------------

def test_the_interpreted_suite():
    """Reruns this file's Triton tests with ``TRITON_INTERPRET=1`` set before Triton loads."""
    run_interpreted(Path(__file__), TRITON_TESTS)
