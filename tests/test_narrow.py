"""The LoRA's narrow-output products (``kohakumoss/kernels/narrow.py``): the Triton kernel
(``triton_narrow.py``) against ``torch.mm``, each way of making them giving a LoRA node the
same values, and a failing kernel falling back to cuBLAS.

As in ``test_kernel_backends.py``: on a CPU machine the Triton tests run interpreted, in a
subprocess started with ``TRITON_INTERPRET=1`` (``test_the_interpreted_suite``); on a CUDA
machine compiled, and the ``gpu`` tests add the real model's sizes.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kohakumoss.adapters.folded import lora_linear, lora_linears
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


def node_values(dtype: torch.dtype) -> list[torch.Tensor]:
    """A LoRA node's output and every gradient (q, k, v as one node, and one linear alone),
    with the narrow products made as ``narrow.BACKEND`` says."""
    g = torch.Generator().manual_seed(3)
    x = leaf(g, 29, 24, dtype=dtype)
    parts = [(leaf(g, 16, 24, dtype=dtype, grad=False), leaf(g, 4, 24, dtype=dtype),
              leaf(g, 16, 4, dtype=dtype), 0.5) for _ in range(3)]
    ys = lora_linears(x, parts) + [lora_linear(x, parts[0][0], None, parts[0][1], parts[0][2], 2.0)]
    sum((y.float() ** 2).sum() for y in ys).backward()
    return [y.detach() for y in ys] + [x.grad] + [t.grad for _, d, u, _ in parts for t in (d, u)]


@pytest.mark.parametrize("name", narrow.BACKENDS)
def test_every_way_gives_a_lora_node_the_same_values(name, backend):
    """Each way of making the narrow products: the LoRA node's output and every gradient as
    with ``torch.mm`` (fp32, to the order of the sums; on the CPU ``triton`` is cuBLAS's)."""
    backend("cublas")
    want = node_values(torch.float32)
    backend(name)
    for a, b in zip(node_values(torch.float32), want):
        assert rel(a, b) <= 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("name", narrow.BACKENDS)
def test_every_way_on_the_gpu(name, backend):
    """The same in bf16 on CUDA, where ``triton`` runs the kernel: within bf16's rounding."""
    if not CUDA:
        pytest.skip("needs CUDA")
    backend("cublas")
    want = node_values(torch.bfloat16)
    backend(name)
    for a, b in zip(node_values(torch.bfloat16), want):
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
