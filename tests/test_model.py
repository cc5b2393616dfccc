"""The DiT: parity with the reference vectors, packing, skip layers, numerics facts."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from kohakumoss.model import FLAVORS, MOSSImageTransformer, build_layout, cast_model
from kohakumoss.model import ops
from kohakumoss.model.engines import Handle
from kohakumoss.checks.parity import rel_error, run_parity
from kohakumoss.diffusion.sampler import skipping
from stages.cli import app

from conftest import ROOT

VECTORS = ROOT / "tests" / "data" / "vectors"


def test_parity_with_public_vectors():
    results = run_parity(VECTORS)
    names = {c.name for c in results}
    assert {"official fp32 velocity vs v_fp32", "official fp64 velocity vs v_fp64",
            "comfy fp32 velocity vs v_fp32", "comfy fp64 velocity vs v_fp64"} <= names
    bad = [c.line() for c in results if not c.passed]
    assert not bad, bad
    assert all(c.error <= 1e-5 for c in results if "fp32" in c.name)


def test_parity_command_fails_on_a_wrong_vector_set(tmp_path):
    runner = CliRunner()
    ok = runner.invoke(app, ["check", "parity", str(VECTORS)])
    assert ok.exit_code == 0 and "FAIL" not in ok.output and "PASS" in ok.output
    bad = tmp_path / "vectors"
    shutil.copytree(VECTORS, bad)
    batch = load_file(str(bad / "batch.safetensors"))
    batch["v_fp32"] = batch["v_fp32"] * 1.001
    save_file(batch, str(bad / "batch.safetensors"))
    res = runner.invoke(app, ["check", "parity", str(bad)])
    assert res.exit_code == 1 and "FAIL  official fp32 velocity" in res.output


def _model(dtype=torch.float64, seed=0, config=FLAVORS["tiny"]):
    torch.manual_seed(seed)
    m = MOSSImageTransformer(config)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3 if p.ndim == 2 else 0.05).add_(1.0 if p.ndim == 1 and p.shape[0] < 200 else 0)
    return cast_model(m, dtype).eval()


def _inputs(hw, text_len, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    c = FLAVORS["tiny"]
    n_img = sum(h * w for h, w in hw)
    img = torch.randn(n_img, c.latent_channels, generator=g, dtype=dtype)
    txt = torch.randn(sum(text_len), c.text_dim, generator=g, dtype=dtype)
    sigma = torch.rand(len(hw), generator=g)
    return img, txt, sigma


def test_packed_batch_equals_each_sample_alone():
    m = _model()
    hw, lens = [(3, 4), (5, 2), (1, 1), (2, 3)], [7, 4, 0, 9]
    img, txt, sigma = _inputs(hw, lens)
    with torch.no_grad():
        packed = m(img, txt, sigma, build_layout(hw, lens))
        i0 = t0 = 0
        for i, ((h, w), L) in enumerate(zip(hw, lens)):
            alone = m(img[i0:i0 + h * w], txt[t0:t0 + L], sigma[i:i + 1], build_layout([(h, w)], [L]))
            assert rel_error(packed[i0:i0 + h * w], alone) < 1e-12
            i0, t0 = i0 + h * w, t0 + L


def test_skip_layer_equals_removing_the_block():
    m = _model()
    hw, lens = [(3, 3)], [5]
    img, txt, sigma = _inputs(hw, lens)
    lay = build_layout(hw, lens)
    with torch.no_grad():
        skipped = m(img, txt, sigma, lay, replace=skipping([1]))
        full = m(img, txt, sigma, lay)
        m.layers = torch.nn.ModuleList([m.layers[0], m.layers[2]])
        removed = m(img, txt, sigma, lay)
    assert torch.equal(skipped, removed)
    assert rel_error(skipped, full) > 1e-3


def test_samples_skipping_a_layer_keep_their_value_and_the_others_are_unchanged():
    """The sampler's skipped layer (``skipping``) with its samples as a tensor (``torch.where`` over every token) and as host flags whose
    skipped samples come last (the layer runs on the leading samples' tokens alone) agree,
    and each sample equals its own forward with or without the layer."""
    m = _model()
    hw, lens = [(3, 3), (2, 3), (3, 2)], [5, 4, 6]
    img, txt, sigma = _inputs(hw, lens)
    lay = build_layout(hw, lens)
    with torch.no_grad():
        for flags in [(False, True, True), (False, False, True), (True, True, True), (True, False, True)]:
            as_tensor = m(img, txt, sigma, lay, replace=skipping([1], torch.tensor(flags)))
            as_flags = m(img, txt, sigma, lay, replace=skipping([1], list(flags)))
            assert rel_error(as_flags, as_tensor) < 1e-12
            i0, t0 = 0, 0
            for i, ((h, w), L) in enumerate(zip(hw, lens)):
                alone = m(img[i0:i0 + h * w], txt[t0:t0 + L], sigma[i:i + 1], build_layout([(h, w)], [L]),
                          replace=skipping([1] if flags[i] else []))
                assert rel_error(as_flags[i0:i0 + h * w], alone) < 1e-12
                i0, t0 = i0 + h * w, t0 + L


def test_zero_gates_make_every_block_the_identity():
    m = _model()
    D = m.config.dim
    with torch.no_grad():
        for chunk in (2, 5):
            m.shared_block_modulation.weight[chunk * D:(chunk + 1) * D] = 0
            m.shared_block_modulation.bias[chunk * D:(chunk + 1) * D] = 0
    seen = []
    m.layers[1].register_forward_hook(lambda mod, args, out: seen.append(torch.equal(args[0], out)))
    m.engines.register(Handle("a hook", blocks=(m.layers[1],)))  # its calls must happen
    hw, lens = [(2, 2)], [3]
    with torch.no_grad():
        m(*_inputs(hw, lens), build_layout(hw, lens))
    assert seen == [True]


def test_numeric_facts():
    e = ops.timestep_embedding(torch.zeros(1), 256)
    assert torch.equal(e[0, :128], torch.ones(128)) and torch.equal(e[0, 128:], torch.zeros(128))
    assert ops.situ(torch.zeros(3), torch.tensor([-5.0, 0.0, 5.0])).abs().max() == 0
    big = ops.situ(torch.tensor([1e4, -1e4]), torch.tensor([1e4, 1e4]))
    assert torch.allclose(big, torch.tensor([100.0, -100.0]))
    # rope: axis-0 slots are identities (position 0); rotation preserves per-head norms
    lay = build_layout([(4, 4)], [3])
    bands = MOSSImageTransformer(FLAVORS["tiny"]).rope.bands
    cos, sin = ops.rope_angles(lay.pos_joint, bands, 4, torch.float64)
    assert torch.equal(cos[:, :4], torch.ones_like(cos[:, :4])) and sin[:, :4].abs().max() == 0
    x = torch.randn(lay.n_joint, 2, 32, dtype=torch.float64)
    y = ops.qk_norm_rope(x, torch.ones(32, dtype=torch.float64), cos, sin, 0.0)
    assert torch.allclose(y.norm(dim=-1), ops.rms_norm(x, torch.ones(32), 0.0).norm(dim=-1))
    assert lay.pos_joint[:16, 1].eq(3).all() and set(lay.pos_joint[:16, 2].tolist()) == {-1.5, -0.5, 0.5, 1.5}


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
def test_half_precision_runs_and_agrees(dtype, tol):
    m32 = _model(torch.float32)
    m16 = cast_model(_model(torch.float32), dtype)
    assert m16.time_embedding[0].weight.dtype == torch.float32
    assert m16.layers[0].proj["q"].weight.dtype == dtype
    hw, lens = [(4, 4), (2, 3)], [6, 2]
    img, txt, sigma = _inputs(hw, lens, torch.float32)
    lay = build_layout(hw, lens)
    with torch.no_grad():
        ref = m32(img, txt, sigma, lay)
        out = m16(img, txt, sigma, lay)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_error(out, ref) < tol


def test_backward_reaches_every_parameter():
    m = _model(torch.float32).train()
    hw, lens = [(2, 3), (3, 2)], [4, 5]
    img, txt, sigma = _inputs(hw, lens, torch.float32)
    m(img, txt, sigma, build_layout(hw, lens)).square().mean().backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing


def test_token_subset_keeps_cell_positions():
    full = build_layout([(3, 4)], [2])
    sub = build_layout([(3, 4)], [2], keep=[torch.tensor([0, 5, 11]).numpy()])
    assert sub.n_img == 3
    assert torch.equal(sub.pos_joint[:3], full.pos_joint[[0, 5, 11]])


def test_each_model_has_its_own_op_table():
    a, b = MOSSImageTransformer(FLAVORS["tiny"]), MOSSImageTransformer(FLAVORS["tiny"])
    assert a.ops is not b.ops and a.ops.names() == b.ops.names()
    assert all(getattr(a.ops, n).fn is f for n, f in ops.REFERENCE.items())  # plain references
    a.ops.override("situ", lambda u, g: ops.situ(u, g))
    assert b.ops.situ.fn is ops.situ and a.ops.situ.fn is not ops.situ
    with pytest.raises(KeyError, match="unknown op 'nope'"):
        a.ops.override("nope", ops.situ)