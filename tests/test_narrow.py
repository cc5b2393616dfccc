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


@pytest.mark.parametrize("name", narrow.BACKENDS)
def test_every_way_is_the_product(name, backend):
    """Each way of making a narrow product: ``torch.mm``'s values (fp32, to the order of the
    sums; on the CPU ``triton`` is cuBLAS's), w as a transposed view and as it is."""
    g = torch.Generator().manual_seed(3)
    x = leaf(g, 29, 24, grad=False)
    backend(name)
    for w in (leaf(g, 4, 24, grad=False).t(), leaf(g, 24, 4, grad=False)):
        got = narrow.narrow_mm(x, w)
        assert got.shape == (29, 4) and rel(got, torch.mm(x, w)) <= 1e-6


@triton_test
@pytest.mark.parametrize("full", [False, True], ids=["on", "full"])
@pytest.mark.parametrize("name", narrow.BACKENDS)
def test_every_way_gives_the_fp8_lora_node_the_same_values(name, full, backend):
    """The fp8 LoRA node (q, k, v as one; ``fp8_compute``: ``torch._scaled_mm``, which the
    CPU has too) with its narrow products made each way: the outputs and the gradients of x
    and the LoRA factors as with cuBLAS, within bf16's rounding (on CUDA ``triton`` runs the
    kernel; on the CPU it is cuBLAS's)."""
    needs_triton()
    from kohakumoss.kernels import KERNELS
    from test_quant_kernels import fp8_loras

    fn = KERNELS.backend("fp8_lora_linears", "scaled_mm").fn

    def values():
        n = 300 if CUDA else 40  # rows; interpreted, a few
        x, layers = fp8_loras(torch.Generator().manual_seed(5), 3, n, 64, 48, 8)
        ys = fn(x, layers, full)
        sum((y.float() ** 2).sum() for y in ys).backward()
        return [y.detach() for y in ys] + [x.grad] + [t.grad for _, _, d, u in layers for t in (d, u)]

    backend("cublas")
    want = values()
    backend(name)
    for a, b in zip(values(), want):
        assert rel(a, b) <= 1e-2
    assert not narrow._broken


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
