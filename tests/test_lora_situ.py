"""The up|gate linear, its LoRA and SiTU as one node (``adapters/folded.py``: ``lora_situ``;
``kernels/triton_lora_situ.py``) against the separate ops: the forward and every gradient
(input, base weight, LoRA down and up), in fp32, bf16 and fp16; and a model whose table runs
SiTU in Triton takes that node for every block's up|gate linear (``adapters/shared.py``:
``shared_linear_situ``), with the separate route's outputs and gradients, and keeps the
separate route where a hook or the table says so.

Where the kernels run: as ``test_kernel_backends.py`` (compiled on CUDA, interpreted on a
CPU machine through ``test_the_interpreted_suite`` here).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kohakumoss.adapters import apply_adapters, folded
from kohakumoss.kernels import backends, build_op_table
from kohakumoss.model import ops

from test_adapters import _batch, _cfg, _model
from test_kernel_backends import (COMMON, CUDA, DEVICE, DTYPES, INTERPRETED, TOL, _ids, leaf, needs_triton,
                                  rel, run_interpreted)

TESTS: list[str] = []


def triton_test(fn):
    TESTS.append(fn.__name__)
    return fn


def separate(x, w, down, up, alpha):
    """The route without the node: the LoRA linear's output, split, then SiTU."""
    y = F.linear(x, w) + alpha * F.linear(F.linear(x, down), up)
    u, g = y.split(y.shape[-1] // 2, dim=-1)
    return ops.situ(u, g)


def _errors(fn, leaves: list[torch.Tensor], truth: torch.Tensor, truth_grads, grad_out) -> list[float]:
    """Relative errors of ``fn(*leaves)`` and of its gradients against float64's."""
    out = fn(*leaves)
    asked = [t for t in leaves if t.requires_grad]
    grads = torch.autograd.grad(out, asked, grad_out.to(out.dtype))
    return [rel(out, truth), *(rel(a, e) for a, e in zip(grads, truth_grads))]


@triton_test
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("rows,width,rank", [(1, 40, 1), (37, 130, 4), (50, 64, 32), (3, 16, 20)],
                         ids=str)
def test_the_node_is_the_separate_ops(rows, width, rank, dtype):
    """Over u and g where both tanh saturate and near zero: rows and columns past a tile,
    ranks below, at and past the dot's 16, a multiplier other than 1; a trained and a frozen
    base weight. Against float64's output and gradients, the node's error is the dtype's
    (fp32: 1e-5) or at most twice the separate ops' in that dtype: the two round the sum of
    the base and the delta at different places, and a gradient summed over every row (the
    LoRA's) carries bf16's rounding of its terms either way."""
    needs_triton()
    kernels = backends.triton_module("triton_lora_situ")
    g = torch.Generator().manual_seed(11)
    K, alpha = 24, 0.7
    for frozen in (False, True):
        x = leaf(g, 2, rows, K, dtype=dtype)
        w = leaf(g, 2 * width, K, dtype=dtype, scale=2.0, grad=not frozen)
        down = leaf(g, rank, K, dtype=dtype, scale=0.5)
        up = leaf(g, 2 * width, rank, dtype=dtype, scale=0.5)
        leaves = [x, w, down, up]
        wide = [t.detach().double().requires_grad_(t.requires_grad) for t in leaves]
        truth = separate(*wide, alpha)
        grad_out = torch.randn(truth.shape, generator=torch.Generator().manual_seed(1),
                               dtype=torch.float64).to(DEVICE)
        truth_grads = torch.autograd.grad(truth, [t for t in wide if t.requires_grad], grad_out)
        node = _errors(lambda *a: folded.lora_situ(*a, alpha, kernels), leaves, truth, truth_grads,
                       grad_out)
        apart = _errors(lambda *a: separate(*a, alpha), leaves, truth, truth_grads, grad_out)
        for name, a, b in zip(["out", "dx", *(["dw"] if not frozen else []), "ddown", "dup"], node, apart):
            assert a <= max(TOL[dtype], 2 * b), f"{name}: {a:.2e} against {b:.2e} apart"


def _trained(model, aset) -> None:
    with torch.no_grad():
        for p in aset.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.1)


@triton_test
def test_a_model_runs_each_up_gate_lora_and_situ_as_one_node(monkeypatch):
    """fp32, the tiny model with SiTU on Triton: one node per block, the separate route's
    output and LoRA gradients; a hook on one block's up|gate linear, or a table whose SiTU is
    the reference, sends those calls the separate way."""
    needs_triton()
    inputs, target = _batch(torch.float32)
    inputs = tuple(t.to(DEVICE) for t in inputs)  # the layout too
    target = target.to(DEVICE)
    model = _model(torch.float32).to(DEVICE)
    model.ops = build_op_table(DEVICE, torch.float32, {"situ": ["triton"]})
    aset = apply_adapters(model, _cfg("lora", mode="bypass"), seed=0)
    _trained(model, aset)
    calls = []
    apply = folded._LoraSitu.apply
    monkeypatch.setattr(folded._LoraSitu, "apply", lambda *a: calls.append(1) or apply(*a))

    def run():
        for p in aset.trainable_parameters():
            p.grad = None
        out = model(*inputs)
        F.mse_loss(out, target).backward()
        return out, [p.grad.clone() for p in aset.trainable_parameters()]

    out, grads = run()
    assert len(calls) == len(model.layers)
    up_gate = model.layers[1].proj["ffn_up_gate"]
    hook = up_gate.register_forward_hook(lambda m, a, y: None)
    calls.clear()
    hooked, hooked_grads = run()
    assert len(calls) == len(model.layers) - 1
    hook.remove()
    situ = model.ops.situ
    model.ops.override("situ", ops.situ)  # the reference SiTU: no fused kernel to add the delta
    calls.clear()
    ref, ref_grads = run()
    assert not calls
    model.ops.override("situ", situ)
    model.ops.override("linear_situ", ops.linear_situ)  # the separate route with Triton's SiTU
    sep, sep_grads = run()
    assert not calls
    for o in (out, hooked, sep):
        assert rel(o, ref) <= 1e-5
    for gs in (grads, hooked_grads, sep_grads):
        for a, e in zip(gs, ref_grads):
            assert rel(a, e) <= 1e-5


def test_the_separate_route_where_the_table_has_no_triton_situ():
    """The reference table (any device, here the CPU): every block's up|gate linear and SiTU
    run separately, with the plain model's ops, and the adapters' table entry says so."""
    model = _model(torch.float32)
    aset = apply_adapters(model, _cfg("lora", mode="bypass"), seed=0)
    _trained(model, aset)
    inputs, target = _batch(torch.float32)
    assert model.ops.linear_situ.__name__ == "shared_linear_situ"
    out = model(*inputs)
    model.ops.override("linear_situ", ops.linear_situ)
    assert torch.equal(out, model(*inputs))


def test_the_interpreted_suite():
    """Reruns this file's Triton tests with ``TRITON_INTERPRET=1`` (``test_kernel_backends``)."""
    if CUDA or INTERPRETED:
        pytest.skip("the Triton tests ran in this process")
    if COMMON is None:
        pytest.skip(f"triton is not installed here ({backends.triton_unavailable_reason('situ')})")
    run_interpreted(Path(__file__), TESTS)
