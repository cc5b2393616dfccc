"""The LoRA's narrow-output products (``narrow_mm``, the adapter set's own table,
``adapters/ops.py``): every adapted linear's ``h = x A^T`` and ``t = dy B`` go through it.
Its one way is ``torch.mm`` (the other ways measured lost in a step: ``docs/history.md``)."""

from __future__ import annotations

import torch

from kohakumoss.adapters.ops import narrow_mm

from test_kernel_backends import DEVICE, _tiny_inputs


def test_a_models_table_makes_its_lora_nodes_narrow_products():
    """A step's output and LoRA gradients with a counting ``narrow_mm`` are the plain
    table's, and every adapted linear's h and t went through it (the bf16 node of q|k|v and
    of each lone linear)."""
    from kohakumoss.adapters import apply_adapters
    from kohakumoss.config import AdapterConfig
    from kohakumoss.model.build import tiny_transformer

    img, text, sigma, layout = _tiny_inputs(torch.float32)
    runs = []
    for counted in (False, True):
        model = tiny_transformer().to(DEVICE)
        adapters = apply_adapters(model, AdapterConfig(algo="lora", dim=4, alpha=4.0), seed=0)
        calls = []
        if counted:
            adapters.ops.override("narrow_mm", lambda x, w: calls.append(tuple(w.shape)) or narrow_mm(x, w))
        v = model(img, text, sigma, layout.to(DEVICE))
        v.square().mean().backward()
        runs.append((v, [p.grad for _, p in adapters.named_trainable()], calls))
    (v_a, g_a, _), (v_b, g_b, calls) = runs
    depth = tiny_transformer().config.depth
    # per block: h of q|k|v (one, x read once) and t of each; h and t of o, up|gate and down
    assert len(calls) == (1 + 3 + 3 * 2) * depth
    assert torch.equal(v_b, v_a) and all(a is None or torch.equal(a, b) for a, b in zip(g_a, g_b))
