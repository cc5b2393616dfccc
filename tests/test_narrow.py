"""The LoRA's narrow-output products (``kohakumoss/kernels/narrow.py``): the Triton kernel
(``triton_narrow.py``) against ``torch.mm``, each way of making them giving the fp8 LoRA
node the same values, and a failing kernel falling back to cuBLAS.

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


@pytest.fixture
def backend():
    """Sets ``narrow.BACKEND`` for a test; puts it back after."""
    kept = narrow.BACKEND
    yield lambda name: setattr(narrow, "BACKEND", name)
    narrow.BACKEND = kept
    narrow._broken.clear()


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
    with pytest.raises(ValueError, match="narrow_mm"):
        tn.narrow_mm(x, leaf(g, K + 1, R, dtype=dtype, grad=False))


def test_the_transposed_way_is_the_product(backend):
    """``cublas-t``: ``torch.mm``'s values (fp32, to the order of the sums) as a [M, R] view,
    w as a transposed view (``A^T``) and as it is (``B``)."""
    g = torch.Generator().manual_seed(3)
    x = leaf(g, 29, 24, grad=False)
    backend("cublas-t")
    for w in (leaf(g, 4, 24, grad=False).t(), leaf(g, 24, 4, grad=False)):
        got = narrow.narrow_mm(x, w)
        assert got.shape == (29, 4) and rel(got, torch.mm(x, w)) <= 1e-6


def test_the_triton_way_leaves_what_it_does_not_take_to_cublas(backend, monkeypatch):
    """``triton`` takes bf16/fp16 CUDA tensors of rank <= 256 alone: CPU tensors, fp32 and
    wider factors go to ``torch.mm`` without the kernel being asked for."""
    asked = []
    monkeypatch.setattr(narrow, "triton_module", lambda name: asked.append(name))
    backend("triton")
    g = torch.Generator().manual_seed(4)
    x, w, wide = torch.randn(9, 24, generator=g), torch.randn(24, 4, generator=g), torch.randn(24, 257, generator=g)
    cases = [(x.bfloat16(), w.bfloat16()), (x.to(DEVICE), w.to(DEVICE))]  # on the CPU; fp32
    if CUDA:
        cases.append((x.bfloat16().cuda(), wide.bfloat16().cuda()))  # rank 257
    for a, b in cases:
        assert torch.equal(narrow.narrow_mm(a, b), torch.mm(a, b))
    assert asked == []


def fp8_node_values(full: bool) -> list[torch.Tensor]:
    """The fp8 LoRA node (q, k, v as one; ``fp8_compute``: ``torch._scaled_mm``, which the
    CPU has too): its outputs and the gradients of x and the LoRA factors, the narrow products
    made as ``narrow.BACKEND`` says."""
    from kohakumoss.kernels import KERNELS
    from test_quant_kernels import fp8_loras

    fn = KERNELS.backend("fp8_lora_linears", "scaled_mm").fn
    n = 300 if CUDA else 40  # rows; interpreted, a few
    x, layers = fp8_loras(torch.Generator().manual_seed(5), 3, n, 64, 48, 8)
    ys = fn(x, layers, full)
    sum((y.float() ** 2).sum() for y in ys).backward()
    return [y.detach() for y in ys] + [x.grad] + [t.grad for _, _, d, u in layers for t in (d, u)]


def same_as_cublas(name: str, full: bool, backend) -> None:
    backend("cublas")
    want = fp8_node_values(full)
    backend(name)
    for a, b in zip(fp8_node_values(full), want):
        assert rel(a, b) <= 1e-2
    assert not narrow._broken


@triton_test
@pytest.mark.parametrize("full", [False, True], ids=["on", "full"])
def test_the_transposed_way_gives_the_fp8_lora_node_the_same_values(full, backend):
    """The node with ``cublas-t``'s [tokens, r] views for h and t (the row quantization's
    tail and the saved h take them as they are): cuBLAS's values within bf16's rounding."""
    needs_triton()
    same_as_cublas("cublas-t", full, backend)


@pytest.mark.gpu
@pytest.mark.parametrize("full", [False, True], ids=["on", "full"])
@pytest.mark.parametrize("name", ["cublas-t", "triton"])
def test_every_way_gives_the_fp8_lora_node_the_same_values_on_the_gpu(name, full, backend):
    """The same on CUDA, where ``triton`` runs the kernel."""
    if not CUDA or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs CUDA sm89+")
    same_as_cublas(name, full, backend)


def test_a_failing_kernel_falls_back_to_cublas_and_says_so(backend, monkeypatch, caplog):
    """The Triton kernel raising (a build failure on some card): said once, and every product
    from then on made by cuBLAS, with its values."""
    calls = []

    class Broken:
        @staticmethod
        def narrow_mm(x, w):
            calls.append(1)
            raise RuntimeError("out of resource: shared memory")

    monkeypatch.setattr(narrow, "triton_module", lambda name: Broken)
    x, w = torch.randn(8, 6), torch.randn(6, 2)
    if not CUDA:  # the kernel is taken for CUDA tensors only: pretend, on the CPU
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    backend("triton")
    with caplog.at_level(logging.WARNING, "kohakumoss.kernels.narrow"):
        for _ in range(3):
            got = narrow.narrow_mm(x.bfloat16().to(DEVICE), w.bfloat16().to(DEVICE))
            assert torch.equal(got, torch.mm(x.bfloat16(), w.bfloat16()).to(DEVICE))
    assert calls == [1]
    assert [r.getMessage() for r in caplog.records] == [
        "narrow products: the Triton kernel failed (RuntimeError: out of resource: shared memory); "
        "using cuBLAS from now on"]


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
