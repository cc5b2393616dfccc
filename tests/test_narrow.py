"""The LoRA's narrow-output products (``ops.narrow_mm``'s backends, ``kohakumoss/kernels/
narrow.py``): the Triton kernel (``triton_narrow.py``) against ``torch.mm``, each way giving
the fp8 LoRA node and a model's bf16 LoRA nodes the same values, and a failing way falling
back to the next choice, said once.

As in ``test_kernel_backends.py``: on a CPU machine the Triton tests run interpreted, in a
subprocess started with ``TRITON_INTERPRET=1`` (``test_the_interpreted_suite``); on a CUDA
machine compiled, and the ``gpu`` tests add the real model's sizes.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kohakumoss.kernels import narrow

from test_kernel_backends import CUDA, DEVICE, leaf, needs_triton, rel, run_interpreted

TRITON_TESTS: list[str] = []


def triton_test(fn):
    TRITON_TESTS.append(fn.__name__)
    return fn


WAYS = {"cublas-t": narrow.cublas_t, "triton": narrow.triton_narrow}


@triton_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 24, 5), (37, 40, 32), (70, 48, 96)], ids=str)
def test_the_kernel_is_the_product(shape, dtype):
    """``narrow_mm`` against ``torch.mm`` in fp64: one row, rows and K over several blocks,
    a rank that is not a power of two; w as a transposed view (``A^T``) and as it is (``B``)."""
    needs_triton()
    tn = pytest.importorskip("kohakumoss.kernels.triton_narrow")
    M, K, R = shape
    g = torch.Generator().manual_seed(M + K + R)
    x = leaf(g, M, K, dtype=dtype, grad=False)
    for w in (leaf(g, R, K, dtype=dtype, grad=False).t(), leaf(g, K, R, dtype=dtype, grad=False)):
        got = tn.narrow_mm(x, w)
        assert got.shape == (M, R) and got.dtype == dtype and got.is_contiguous()
        want = (x.double() @ w.double()).to(dtype)  # fp32 sums, one rounding: the rounded exact product
        assert rel(got, want) <= {torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]
        assert rel(narrow.triton_narrow(x, w), want) <= {torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]
    with pytest.raises(ValueError, match="narrow_mm"):
        tn.narrow_mm(x, leaf(g, K + 1, R, dtype=dtype, grad=False))


def test_the_transposed_way_is_the_product():
    """``cublas-t``: ``torch.mm``'s values (fp32, to the order of the sums) as a [M, R] view,
    w as a transposed view (``A^T``) and as it is (``B``)."""
    g = torch.Generator().manual_seed(3)
    x = leaf(g, 29, 24, grad=False)
    for w in (leaf(g, 4, 24, grad=False).t(), leaf(g, 24, 4, grad=False)):
        got = narrow.cublas_t(x, w)
        assert got.shape == (29, 4) and rel(got, torch.mm(x, w)) <= 1e-6


def test_the_triton_way_leaves_what_it_does_not_take_to_cublas(monkeypatch):
    """``triton`` takes bf16/fp16 tensors where Triton runs, of rank <= 256: CPU tensors
    (Triton compiled), fp32 and wider factors go to ``torch.mm`` without the kernel being
    asked for."""
    from test_kernel_backends import INTERPRETED

    if INTERPRETED:
        pytest.skip("interpreted, the kernel takes CPU tensors")
    asked = []
    real = narrow.triton_module
    monkeypatch.setattr(narrow, "triton_module",
                        lambda name: asked.append(name) if name == "triton_narrow" else real(name))
    g = torch.Generator().manual_seed(4)
    x, w, wide = torch.randn(9, 24, generator=g), torch.randn(24, 4, generator=g), torch.randn(24, 257, generator=g)
    cases = [(x.bfloat16(), w.bfloat16()), (x.to(DEVICE), w.to(DEVICE))]  # on the CPU; fp32
    if CUDA:
        cases.append((x.bfloat16().cuda(), wide.bfloat16().cuda()))  # rank 257
    for a, b in cases:
        assert torch.equal(narrow.triton_narrow(a, b), torch.mm(a, b))
    assert asked == []


def fp8_node_values(full: bool, way=torch.mm) -> list[torch.Tensor]:
    """The fp8 LoRA node (q, k, v as one; ``fp8_compute``: ``torch._scaled_mm``, which the
    CPU has too): its outputs and the gradients of x and the LoRA factors, the narrow products
    made by ``way``."""
    from kohakumoss.kernels import KERNELS
    from test_quant_kernels import fp8_loras

    fn = KERNELS.backend("fp8_lora_linears", "scaled_mm").fn
    n = 300 if CUDA else 40  # rows; interpreted, a few
    x, layers = fp8_loras(torch.Generator().manual_seed(5), 3, n, 64, 48, 8)
    ys = fn(x, layers, full, way)
    sum((y.float() ** 2).sum() for y in ys).backward()
    return [y.detach() for y in ys] + [x.grad] + [t.grad for _, _, d, u in layers for t in (d, u)]


def same_as_cublas(name: str, full: bool) -> None:
    calls = []
    way = WAYS[name]
    got = fp8_node_values(full, lambda x, w: calls.append(1) or way(x, w))
    assert len(calls) == 4  # h forward, and t for each of the three linears
    for a, b in zip(got, fp8_node_values(full)):
        assert rel(a, b) <= 1e-2


@triton_test
@pytest.mark.parametrize("full", [False, True], ids=["on", "full"])
def test_the_transposed_way_gives_the_fp8_lora_node_the_same_values(full):
    """The node with ``cublas-t``'s [tokens, r] views for h and t (the row quantization's
    tail and the saved h take them as they are): cuBLAS's values within bf16's rounding."""
    needs_triton()
    same_as_cublas("cublas-t", full)


@pytest.mark.gpu
@pytest.mark.parametrize("full", [False, True], ids=["on", "full"])
@pytest.mark.parametrize("name", ["cublas-t", "triton"])
def test_every_way_gives_the_fp8_lora_node_the_same_values_on_the_gpu(name, full):
    """The same on CUDA, where ``triton`` runs the kernel."""
    if not CUDA or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs CUDA sm89+")
    same_as_cublas(name, full)


@triton_test
@pytest.mark.parametrize("name", ["cublas-t", "triton"])
def test_a_models_table_makes_its_lora_nodes_narrow_products(name):
    """The model passes its table's ``narrow_mm`` to the LoRA nodes (``ops.linears``, the bf16
    node of q|k|v and of each lone linear): a step's output and LoRA gradients with each way are
    the reference's (interpreted, the Triton kernel runs on the CPU), and every adapted
    linear's h and t went through it."""
    needs_triton()
    from kohakumoss.adapters import apply_adapters
    from kohakumoss.config import AdapterConfig
    from kohakumoss.model.build import tiny_transformer
    from test_kernel_backends import _tiny_inputs

    img, text, sigma, layout = _tiny_inputs(torch.float32)
    runs = []
    for way in (None, WAYS[name]):
        model = tiny_transformer().to(DEVICE)
        adapters = apply_adapters(model, AdapterConfig(algo="lora", dim=4, alpha=4.0), seed=0)
        calls = []
        if way is not None:
            model.ops.override("narrow_mm", lambda x, w: calls.append(1) or way(x, w))
        v = model(img, text, sigma, layout.to(DEVICE))
        v.square().mean().backward()
        runs.append((v, [p.grad for _, p in adapters.named_trainable()], calls))
    (v_a, g_a, _), (v_b, g_b, calls) = runs
    depth = tiny_transformer().config.depth
    # per block: h of q|k|v (one, x read once) and t of each; h and t of o, up|gate and down
    assert len(calls) == (1 + 3 + 3 * 2) * depth
    assert rel(v_b, v_a) <= 1e-6 and all(rel(a, b) <= 1e-5 for a, b in zip(g_b, g_a) if a is not None)


def test_a_failing_way_is_an_error_naming_it_and_the_knob(monkeypatch):
    """The Triton kernel raising (a build failure on some card) stops the run with the op,
    the backend and the knob that leaves it out (``kernels.backends``): no silent fall-back."""
    from kohakumoss.kernels import KernelRegistry
    from kohakumoss.kernels.dispatch import BackendFailed

    calls = []

    class Broken:
        @staticmethod
        def narrow_mm(x, w):
            calls.append(1)
            raise RuntimeError("out of resource: shared memory")

    monkeypatch.setattr(narrow, "triton_module", lambda name: Broken)
    monkeypatch.setattr(narrow, "_kernel_takes", lambda x, w: True)
    r = KernelRegistry()
    r.register("narrow_mm", "triton", narrow.triton_narrow, lambda device, dtype: True)
    table = r.build_op_table(torch.device("cpu"), torch.bfloat16, {"narrow_mm": ["triton"]})
    x, w = torch.randn(8, 6).bfloat16(), torch.randn(6, 2).bfloat16()
    with pytest.raises(BackendFailed, match=r"narrow_mm: backend triton failed at run time "
                                            r"\(RuntimeError: out of resource: shared memory\); "
                                            r"leave it out with kernels.backends"):
        table.narrow_mm(x, w)
    assert calls == [1]


@pytest.mark.gpu
@pytest.mark.parametrize("K", [3072, 8192, 16384], ids=str)
@pytest.mark.parametrize("R", [32, 96], ids=str)
def test_the_kernel_at_the_real_sizes(K, R):
    """bf16, 16,794 rows (4 samples of 1 MP): within bf16 of the fp64 product, as cuBLAS is."""
    if not CUDA:
        pytest.skip("needs CUDA")
    tn = pytest.importorskip("kohakumoss.kernels.triton_narrow")
    g = torch.Generator().manual_seed(K + R)
    x = leaf(g, 16794, K, dtype=torch.bfloat16, grad=False)
    w = leaf(g, R, K, dtype=torch.bfloat16, grad=False).t() * K ** -0.5
    want = (x.double() @ w.double()).to(torch.bfloat16)
    assert rel(tn.narrow_mm(x, w), want) <= 8e-3
    assert rel(torch.mm(x, w), want) <= 8e-3


# ---- the interpreted suite on a CPU machine ------------------------------------------------

def test_the_interpreted_suite():
    """Reruns this file's Triton tests with ``TRITON_INTERPRET=1`` set before Triton loads."""
    run_interpreted(Path(__file__), TRITON_TESTS)
