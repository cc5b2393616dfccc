"""Adapters: every LyCORIS algorithm trains, merges, round-trips and exports on the tiny DiT;
presets at real size; LoRA+ and weight-decay groups; per-step randomness; the LoRA vectors."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kohakumoss.adapters import (apply_adapters, preset_patterns, resolve_targets, targeted_modules,
                                 targeted_paths)
from kohakumoss.config import AdapterConfig
from kohakumoss.formats.comfy import load_adapter_file
from kohakumoss.formats.lycoris import lycoris_state_dict, save_lycoris
from kohakumoss.model import FLAVORS, MOSSImageTransformer, build_layout
from kohakumoss.checks.parity import lora_comparisons, rel_error

from conftest import ROOT

VECTORS = ROOT / "tests" / "data" / "vectors"
# LyCORIS builds the OFT/BOFT rotation in float32 (``.float().inverse()``): float32 parameters and
# float32 precision for those layers even in a float64 model
FP32_ALGOS = ("oft", "boft")
ALGOS = {"lora": {}, "locon": {}, "loha": {}, "lokr": {"algo_kwargs": {"factor": 4}}, "dora": {},
         "oft": {}, "boft": {"dim": 8}, "glora": {}, "ia3": {}, "dylora": {"dim": 8}, "tlora": {}}


def _model(dtype=torch.float64, seed=0) -> MOSSImageTransformer:
    torch.manual_seed(seed)
    m = MOSSImageTransformer(FLAVORS["tiny"])
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(0, 0.05 if p.ndim == 1 else 0.2).add_(1.0 if "norm" in name else 0.0)
    return m.to(dtype).eval()


def _batch(dtype=torch.float64, sigma=(0.9, 0.2)):
    g = torch.Generator().manual_seed(1)
    c, layout = FLAVORS["tiny"], build_layout([(3, 4), (2, 3)], [5, 3])
    img = torch.randn(layout.n_img, c.latent_channels, generator=g, dtype=dtype)
    txt = torch.randn(layout.n_txt, c.text_dim, generator=g, dtype=dtype)
    target = torch.randn(layout.n_img, c.latent_channels, generator=g, dtype=dtype)
    return (img, txt, torch.tensor(sigma), layout), target


def _cfg(algo: str, **kw) -> AdapterConfig:
    return AdapterConfig(**{"algo": algo, "preset": "all", "dim": 4, "alpha": 2.0, **ALGOS[algo], **kw})


def _same(model, base) -> bool:
    return all(torch.equal(v, base[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("algo", list(ALGOS))
def test_algorithm_trains_merges_round_trips_and_exports(algo, tmp_path):
    model = _model()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    inputs, target = _batch()
    with torch.no_grad():
        y_base = model(*inputs)
    cfg = _cfg(algo)
    aset = apply_adapters(model, cfg, seed=0)
    assert list(model.state_dict()) == list(base)  # wrappers never rename the base keys
    assert not any(p.requires_grad for p in model.parameters())
    master = torch.float32 if algo in FP32_ALGOS else torch.float64
    assert all(p.dtype == master for p in aset.trainable_parameters())
    tol = 1e-5 if algo in FP32_ALGOS else 1e-10
    start = aset.state_dict()
    opt = torch.optim.AdamW(aset.param_groups(1e-2), lr=1e-2)
    for step in range(3):
        aset.prepare_step(step, 0, inputs[2], inputs[3])
        loss = F.mse_loss(model(*inputs), target)
        assert torch.isfinite(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    trained = aset.state_dict()
    assert any(not torch.equal(start[k], trained[k]) for k in start)
    assert _same(model, base)  # the base weights are bit-identical

    aset.eval()
    with torch.no_grad():
        y = model(*inputs)
        assert rel_error(y, y_base) > 1e-4  # the adapter does something
        if algo != "tlora":  # T-LoRA is bypass-only while training
            aset.set_mode("merge")
            assert rel_error(model(*inputs), y) < tol
            aset.set_mode("bypass")
        aset.merge(1.0)
        assert rel_error(model(*inputs), y) < tol
        aset.unmerge()
        assert _same(model, base) and torch.equal(model(*inputs), y)

    # raw state round trip into a fresh adapter (other init seed) on a fresh base
    model2 = _model()
    aset2 = apply_adapters(model2, cfg, seed=1)
    aset2.load_state_dict(trained)
    aset2.eval()
    with torch.no_grad():
        assert rel_error(model2(*inputs), y) < 1e-12

    # LyCORIS native file, loaded back for inference in both modes
    path = save_lycoris(aset, tmp_path / f"{algo}.safetensors", dtype=torch.float64)
    meta_algo = {"dora": "lora", "oft": "diag-oft"}.get(algo, algo)
    assert f'"algo": "{meta_algo}"' in load_file_metadata(path)["ss_network_args"]
    model3 = _model()
    for mode in ("bypass", "merge"):
        handle = load_adapter_file(model3, path, 1.0, mode)
        with torch.no_grad():
            assert rel_error(model3(*inputs), y) < tol, mode
        handle.remove()
        assert _same(model3, base)
        with torch.no_grad():
            assert torch.equal(model3(*inputs), y_base)


VARIANTS = {"ia3-on-input": ("ia3", False, {"train_on_input": True}),
            "dora-input-axis": ("lora", True, {"wd_on_out": False}),
            "loha-dora": ("loha", True, {}),
            "lokr-decompose-both": ("lokr", False, {"factor": 4, "decompose_both": True}),
            "oft-rescaled": ("oft", False, {"constraint": 1e-4, "rescaled": True}),
            "glora-scalar": ("glora", False, {"use_scalar": True})}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_agree_at_a_partial_multiplier(variant, tmp_path):
    algo, dora, kwargs = VARIANTS[variant]
    model = _model()
    inputs, target = _batch()
    aset = apply_adapters(model, _cfg(algo, dora=dora, algo_kwargs=kwargs, dim=4 if algo != "lokr"
                                      else 2), seed=0)
    opt = torch.optim.AdamW(aset.param_groups(1e-2), lr=1e-2)
    for step in range(2):
        F.mse_loss(model(*inputs), target).backward()
        opt.step()
        opt.zero_grad()
    aset.eval()
    tol = 1e-5 if algo in FP32_ALGOS else 1e-10
    with torch.no_grad():
        aset.set_multiplier(0.6)
        y = model(*inputs)
        aset.set_multiplier(1.0)
        aset.merge(0.6)
        assert rel_error(model(*inputs), y) < tol
        aset.unmerge()
        path = save_lycoris(aset, tmp_path / "a.safetensors", dtype=torch.float64)
        for mode in ("bypass", "merge"):
            handle = load_adapter_file(model3 := _model(), path, 0.6, mode)
            assert rel_error(model3(*inputs), y) < tol, mode
            handle.remove()


def test_dense_diff_files_and_fused_diff_split(tmp_path):
    g = torch.Generator().manual_seed(0)
    d = {k: torch.randn(*s, generator=g, dtype=torch.float64) * 0.05
         for k, s in [("q", (64, 64)), ("qkv", (192, 64)), ("proj", (64, 48)), ("proj_b", (64,))]}
    save_file({"diffusion_model.layers.0.proj.q.diff": d["q"], "lora_unet_layers_1_proj_qkv.diff": d["qkv"],
               "text_embedder.proj.diff": d["proj"], "text_embedder.proj.diff_b": d["proj_b"]},
              str(tmp_path / "diff.safetensors"))
    inputs, _ = _batch()
    ref, model = _model(), _model()
    with torch.no_grad():
        ref.layers[0].proj["q"].weight += 0.7 * d["q"]
        for i, x in enumerate("qkv"):
            ref.layers[1].proj[x].weight += 0.7 * d["qkv"][64 * i:64 * (i + 1)]
        ref.text_embedder.proj.weight += 0.7 * d["proj"]
        ref.text_embedder.proj.bias += 0.7 * d["proj_b"]
        for mode in ("bypass", "merge"):
            handle = load_adapter_file(model, tmp_path / "diff.safetensors", 0.7, mode)
            assert rel_error(model(*inputs), ref(*inputs)) < 1e-12
            handle.remove()


def load_file_metadata(path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata()


def test_presets_at_real_size():
    with torch.device("meta"):
        model = MOSSImageTransformer(FLAVORS["base"])
    counts = {p: len(targeted_modules(model, preset_patterns(p)[0]))
              for p in ("attn", "attn-mlp", "full-block", "all")}
    assert counts == {"attn": 168, "attn-mlp": 252, "full-block": 262, "all": 269}
    assert len(targeted_modules(model, preset_patterns("attn+modulation")[0])) == 172
    assert len(targeted_modules(model, preset_patterns("attn-mlp+text-refiner+embed")[0])) == 265
    assert resolve_targets(AdapterConfig()) == preset_patterns("attn-mlp")[0]
    cfg = AdapterConfig(targets=(r"layers\.0\.proj\.q$",))
    assert targeted_modules(model, resolve_targets(cfg)) == ["layers.0.proj.q"]
    with pytest.raises(ValueError, match="attn-mlp.*full-block.*\\+modulation"):
        preset_patterns("attn-only")
    with pytest.raises(ValueError, match=r"layers\.N\.proj\.q"):
        targeted_modules(model, [r"layers\.\d+\.attn\.q$"])


@pytest.mark.parametrize("name", ["tiny", "base"])
def test_module_paths_without_the_model_are_the_built_models(name):
    """``DiTConfig.module_paths`` (what ``kmoss scan`` checks targets against, no torch) lists
    the built model's Linear and RMSNormWeight paths, in order; matching them gives the same
    layers as matching the modules."""
    from torch import nn

    from kohakumoss.model.dit import RMSNormWeight

    with torch.device("meta"):
        model = MOSSImageTransformer(FLAVORS[name])
    linears, norms = FLAVORS[name].module_paths()
    assert linears == [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert norms == [n for n, m in model.named_modules() if isinstance(m, RMSNormWeight)]
    for preset in ("attn", "all+modulation"):
        lin, nrm = preset_patterns(preset)
        assert targeted_paths(linears, norms, lin) == targeted_modules(model, lin)
        assert targeted_paths(linears, norms, nrm, "norm") == targeted_modules(model, nrm, "norm")


def test_loraplus_groups_and_weight_decay_rule():
    model = _model(torch.float32)
    aset = apply_adapters(model, _cfg("lora", dora=True, loraplus_ratio=16.0, preset="attn"), 0)
    groups = aset.param_groups(1e-3, weight_decay=0.1)
    by_name = {n: g for g in groups for n in g["param_names"]}
    up, down = "lora_unet_layers_0_proj_q.lora_up.weight", "lora_unet_layers_0_proj_q.lora_down.weight"
    dora = "lora_unet_layers_0_proj_q.dora_scale"
    assert by_name[up]["lr"] == pytest.approx(1.6e-2) and by_name[down]["lr"] == 1e-3
    assert by_name[up]["weight_decay"] == 0.1 and by_name[dora]["weight_decay"] == 0.0
    assert aset.lr_scale() == {n: 16.0 for n in by_name if n.endswith("lora_up.weight")}
    assert sum(len(g["params"]) for g in groups) == len(aset.trainable_parameters()) == 36
    assert {g["weight_decay"] for g in aset.param_groups(1e-3, 0.1, "all")} == {0.1}
    assert {g["weight_decay"] for g in aset.param_groups(1e-3, 0.1, "none")} == {0.0}
    t = apply_adapters(_model(torch.float32), _cfg("tlora", preset="attn"), 0).param_groups(1e-3, 0.1)
    decay = {n: g["weight_decay"] for g in t for n in g["param_names"]}
    assert decay["lora_unet_layers_0_proj_q.lambda_layer"] == 0.0
    assert decay["lora_unet_layers_0_proj_q.q_layer.weight"] == 0.1


def test_module_dropout_and_dylora_draws_are_reproducible():
    cfg = _cfg("dylora", dim=16, module_dropout=0.5)
    a, b = apply_adapters(_model(), cfg, seed=3), apply_adapters(_model(), cfg, seed=3)
    draw = a.prepare_step(5, 1)
    assert draw == a.prepare_step(5, 1) == b.prepare_step(5, 1)
    assert 0 < len(draw["skipped"]) < len(a.modules)
    assert set(draw["blocks"].values()) <= {1, 2, 3, 4} and len(set(draw["blocks"].values())) > 1
    others = [a.prepare_step(5, 2), a.prepare_step(6, 1), apply_adapters(_model(), cfg, 4).prepare_step(5, 1)]
    assert all(o != draw for o in others)
    # a skipped module runs its base layer only: everything skipped -> the base output
    model = _model()
    inputs, _ = _batch()
    with torch.no_grad():
        y_base = model(*inputs)
    aset = apply_adapters(model, _cfg("lora", module_dropout=0.999), seed=0)
    for lyco in aset.modules.values():
        torch.nn.init.normal_(lyco.lora_up.weight)
    assert len(aset.prepare_step(0, 0)["skipped"]) == len(aset.modules)
    with torch.no_grad():
        assert torch.equal(model(*inputs), y_base)
        aset.eval()
        assert rel_error(model(*inputs), y_base) > 1e-3  # no skipping in eval


def test_tlora_masks_follow_each_tokens_sigma():
    aset = apply_adapters(_model(), _cfg("tlora", dim=8), seed=0)
    assert aset.tlora_ranks(torch.tensor([1.0, 0.99, 0.6, 0.3, 0.0])) == [1, 1, 3, 5, 8]
    inputs, _ = _batch(sigma=(0.99, 0.01))
    layout = inputs[3]
    aset.prepare_step(0, 0, inputs[2], layout)
    rows = {"joint": layout.seg_joint, "text": layout.seg_txt, "image": layout.seg_img,
            "sample": torch.arange(2)}
    for axis, seg in rows.items():
        ranks = aset.masks[axis].sum(1)
        assert torch.equal(ranks, torch.tensor([1.0, 7.0])[seg]), axis
    aset.eval()
    assert aset.masks == {}


def test_train_norms_and_refusals():
    model = _model()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    inputs, _ = _batch()
    aset = apply_adapters(model, _cfg("lora", preset="attn", train_norms=True), seed=0)
    assert len(aset.norms) == 12 and list(model.state_dict()) == list(base)
    for n in aset.norms.values():
        torch.nn.init.normal_(n.w_norm, std=0.1)
    aset.eval()
    with torch.no_grad():
        y = model(*inputs)
        aset.merge(0.5)
        aset.unmerge()
        assert _same(model, base) and torch.equal(model(*inputs), y)
    assert "lora_unet_layers_0_norm1.w_norm" in lycoris_state_dict(aset)
    for bad, match in [(_cfg("tlora", mode="merge"), "bypass"), (_cfg("dora", dropout=0.1), "dropout"),
                       (_cfg("oft", dora=True), "dora"), (AdapterConfig(algo="full"), "full finetune")]:
        with pytest.raises(ValueError, match=match):
            apply_adapters(_model(), bad, seed=0)


def test_lora_vectors_reproduce_reference_velocities():
    results = list(lora_comparisons(VECTORS))
    assert len(results) == 24  # 3 files x fp32/fp64 x bypass/merge x multiplier 1/m2
    bad = [c.line() for c in results if not c.passed]
    assert not bad, bad


def test_unknown_adapter_key_is_an_error(tmp_path):
    sd = load_file(str(VECTORS / "lora_lycoris.safetensors"))
    model = _model()
    for key in ("lora_unet_layers_0_proj_zzz.lora_up.weight", "lora_unet_layers_0_proj_q.lora_sideways"):
        save_file({**sd, key: torch.zeros(2, 2)}, str(tmp_path / "bad.safetensors"))
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            load_adapter_file(model, tmp_path / "bad.safetensors")
    # stems of other styles resolve to the same layers
    styles = {k.replace("lora_unet_layers_0_proj_q.", "diffusion_model.layers.0.proj.q.")
              .replace("lora_unet_layers_1_proj_k.", "transformer.layers.1.proj.k."): v
              for k, v in sd.items()}
    save_file(styles, str(tmp_path / "styles.safetensors"))
    handle = load_adapter_file(model, tmp_path / "styles.safetensors")
    assert len(handle.modules) == 18
    handle.remove()
    assert all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("algo, kw, folded", [
    ("lora", {}, True), ("locon", {}, True), ("lora", {"dropout": 0.2}, False),
    ("lora", {"rank_dropout": 0.2}, False), ("dora", {}, False), ("loha", {}, False)])
def test_a_lora_delta_folds_into_its_base_matmul_only_where_that_is_the_same_math(algo, kw, folded):
    """The folded LoRA (one ``addmm`` onto the base output) gives LyCORIS's own bypass
    output and gradients (float64: round-off only); layers whose delta is not a plain
    low-rank product, or that draw a dropout now, keep LyCORIS's path."""
    from kohakumoss.adapters.runtime import folds

    model = _model()
    aset = apply_adapters(model, _cfg(algo, mode="bypass", **kw), seed=0)
    with torch.no_grad():
        for p in aset.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.1)
    assert all(folds(m) == folded for m in aset.modules.values())
    if not folded:
        return
    inputs, target = _batch()
    torch.manual_seed(0)
    out = model(*inputs)
    F.mse_loss(out, target).backward()
    grads = [p.grad.clone() for p in aset.trainable_parameters()]
    for m in aset.modules.values():  # LyCORIS's own bypass: a trained scalar of 1 stops the fold
        m.scalar = torch.nn.Parameter(torch.ones((), dtype=m.scalar.dtype), requires_grad=False)
        assert not folds(m)
    for p in aset.trainable_parameters():
        p.grad = None
    ref = model(*inputs)
    F.mse_loss(ref, target).backward()
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-14)
    for g, p in zip(grads, aset.trainable_parameters()):
        assert torch.allclose(g, p.grad, rtol=1e-10, atol=1e-14)


def test_the_folded_lora_linear_is_the_separate_ops_with_bias_base_gradients_and_autocast():
    """``folded.lora_linear`` (one autograd node) against the separate ops in float64: the
    output and every gradient (input, base weight and bias, down, up) at a scale != 1, on a
    3-d input; under bf16 autocast it computes in bf16 and hands float32 factors their
    gradients in float32."""
    from kohakumoss.adapters.folded import lora_linear

    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
               for s in ((3, 5, 7), (4, 7), (4,)))
    down, up = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
                for s in ((2, 7), (4, 2)))
    out = lora_linear(x, w, b, down, up, 0.7)
    ref = F.linear(x, w, b) + 0.7 * F.linear(F.linear(x, down), up)
    go = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, (x, w, b, down, up), go)
    want = torch.autograd.grad(ref, (x, w, b, down, up), go)
    assert out.shape == ref.shape and torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    for a, e in zip(grads, want):
        assert torch.allclose(a, e, rtol=1e-12, atol=1e-12)
    d32, u32 = (t.detach().float().requires_grad_() for t in (down, up))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lora_linear(x.detach().float(), w.detach().float(), None, d32, u32, 0.7)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and d32.grad.dtype == u32.grad.dtype == torch.float32


def test_linears_sharing_an_input_as_one_node_are_the_separate_ops():
    """``folded.lora_linears`` (q, k and v as one node) against the separate ops in float64:
    every output, and every gradient (input, base weights, downs, ups) with ranks and
    scales that differ per linear and one output left unused."""
    from kohakumoss.adapters.folded import lora_linears

    g = torch.Generator().manual_seed(2)

    def leaf(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)

    x = leaf(3, 5, 7)
    parts = [(leaf(4, 7), leaf(r, 7), leaf(4, r), a) for r, a in ((2, 0.7), (3, 1.0), (1, 2.0))]
    outs = lora_linears(x, parts)
    refs = [F.linear(x, w) + a * F.linear(F.linear(x, d), u) for w, d, u, a in parts]
    for out, ref in zip(outs, refs):
        assert out.shape == ref.shape and torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    gos = [torch.randn(r.shape, generator=g, dtype=torch.float64) for r in refs]
    leaves = [x, *(t for w, d, u, _ in parts for t in (w, d, u))]
    used = (0, 2)  # k's output unused: its weights get no gradient, the rest theirs alone
    got = torch.autograd.grad([outs[i] for i in used], leaves, [gos[i] for i in used], allow_unused=True)
    want = torch.autograd.grad([refs[i] for i in used], leaves, [gos[i] for i in used], allow_unused=True)
    for a, e in zip(got, want):
        assert (a is None) == (e is None) or torch.count_nonzero(a if e is None else e) == 0
        if a is not None and e is not None:
            assert torch.allclose(a, e, rtol=1e-12, atol=1e-12)


def test_a_model_runs_q_k_and_v_as_one_lora_node_where_all_three_fold(monkeypatch):
    """``apply_adapters`` puts the shared-input node in the model's own op table; the model
    then matches the one-by-one route (float64). A forward pre-hook on one of the three (a
    weight ring's load) runs and keeps the node; a hook on its output sends that block's
    group through the modules."""
    from kohakumoss.adapters import folded
    from kohakumoss.model import ops

    from test_kernel_backends import _graph

    model = _model()
    aset = apply_adapters(model, _cfg("lora", mode="bypass"), seed=0)
    with torch.no_grad():
        for p in aset.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.1)
    inputs, target = _batch()
    calls = []
    apply = folded._LoraLinears.apply
    monkeypatch.setattr(folded._LoraLinears, "apply", lambda *a: calls.append(1) or apply(*a))

    def run():
        for p in aset.trainable_parameters():
            p.grad = None
        out = model(*inputs)
        F.mse_loss(out, target).backward()
        return out, [p.grad.clone() for p in aset.trainable_parameters()]

    out, grads = run()
    assert len(calls) == len(model.layers) and "_LoraLinearsBackward" in _graph(out)
    k = model.layers[0].proj["k"]
    seen = []
    hook = k.register_forward_pre_hook(lambda m, a: seen.append(m) and None)  # runs, keeps the node
    calls.clear()
    pre, pre_grads = run()
    assert seen == [k] and len(calls) == len(model.layers)
    hook.remove()
    hook = k.register_forward_hook(lambda m, a, y: None)  # a hook on the output: the modules' route
    calls.clear()
    hooked, hooked_grads = run()
    assert len(calls) == len(model.layers) - 1
    hook.remove()
    model.ops.override("linears", ops.linears)  # one by one
    ref, ref_grads = run()
    for o in (out, pre, hooked):
        assert torch.allclose(o, ref, rtol=1e-12, atol=1e-14)
    for gs in (grads, pre_grads, hooked_grads):
        for a, e in zip(gs, ref_grads):
            assert torch.allclose(a, e, rtol=1e-10, atol=1e-14)


def test_a_stacked_adapter_keeps_the_separate_path(monkeypatch):
    """A LoRA wrapped around another adapter's forward is not folded into the base weight's
    matmul (that would skip the inner adapter): both adapters act on the output."""
    from kohakumoss.adapters import folded

    model = _model()
    inner = apply_adapters(model, _cfg("loha", mode="bypass"), seed=0)
    outer = apply_adapters(model, _cfg("lora", mode="bypass"), seed=1)
    calls = []
    for node in (folded._LoraLinear, folded._LoraLinears):
        monkeypatch.setattr(node, "apply", functools.partial(
            lambda apply, *a: calls.append(1) or apply(*a), node.apply))
    inputs, _ = _batch()
    outs = []
    with torch.no_grad():
        for p in [*inner.trainable_parameters(), *outer.trainable_parameters()]:
            p.add_(0.1)
        for aset in (None, outer, inner):  # both, then the inner alone, then neither
            for m in aset.modules.values() if aset else ():
                m.multiplier = 0.0
            outs.append(model(*inputs))
    assert not calls
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])


def _lora_bf16(engines=(), grouped=True):
    """A tiny bf16 model with a trained-looking rank-4 LoRA (alpha 2: scale 0.5) in float32,
    its block engines applied; ``grouped=False``: each layer casts its own factors."""
    from kohakumoss.adapters.casts import detach_cast_groups
    from kohakumoss.model.build import tiny_transformer
    from kohakumoss.model.dit import cast_model

    model = cast_model(tiny_transformer(), torch.bfloat16)
    aset = apply_adapters(model, _cfg("lora", mode="bypass"), seed=0)  # preset all: blocks and the rest
    with torch.no_grad():
        for p in aset.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    if not grouped:
        detach_cast_groups(aset.modules, aset.attached.cast_hook)
    for engine in engines:
        engine(model)
    return model, aset


def _lora_step(model, aset):
    inputs, target = _batch(torch.float32)
    for p in aset.trainable_parameters():
        p.grad = None
    out = model(*inputs)
    F.mse_loss(out.float(), target).backward()
    return out, [p.grad.clone() for p in aset.trainable_parameters()]


def test_a_blocks_lora_factors_are_cast_together_exactly_as_one_by_one(monkeypatch):
    """A bf16 step casts each block's float32 LoRA factors in one node per alpha
    (``adapters/casts.py``), once per forward: outputs and gradients are the one-by-one
    casts' bit for bit, also after a fused AdamW step (which writes the parameters without
    bumping their versions), and in forwards without autograd."""
    from kohakumoss.adapters import casts

    builds = []
    apply = casts._JoinedCast.apply
    monkeypatch.setattr(casts._JoinedCast, "apply", lambda *a: builds.append(a[1]) or apply(*a))
    runs = []
    for grouped in (True, False):
        model, aset = _lora_bf16(grouped=grouped)
        opt = torch.optim.AdamW(aset.trainable_parameters(), lr=1e-2, fused=True)
        seen = []
        for _ in range(2):
            builds.clear()
            seen.append(_lora_step(model, aset))
            blocks = len(model.layers) + len(model.text_embedder.blocks)
            assert builds == ([1.0, 0.5] * blocks if grouped else [])  # downs, then the ups
            opt.step()
        builds.clear()
        with torch.no_grad():
            seen.append((model(*_batch(torch.float32)[0]), []))
            seen.append((model(*_batch(torch.float32)[0]), []))
        assert len(builds) == (2 * 2 * blocks if grouped else 0)  # once per block and forward
        runs.append(seen)
    for (out, grads), (ref, ref_grads) in zip(*runs):
        assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
        assert len(grads) == len(ref_grads) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


@pytest.mark.parametrize("engine", ["checkpoint blocks", "sub-block", "selective", "recompute + sub-block",
                                    "partial + rebuild", "offload", "offload halves"])
def test_joint_lora_casts_hold_under_the_memory_engines(engine, monkeypatch):
    """A recomputation in backward reuses the forward's joint casts (no block casts twice;
    under selective checkpointing's dispatch mode each layer casts its own; offload runs its
    forward without autograd, so its recomputation casts again, with it): outputs and LoRA
    gradients equal the plain step's bit for bit."""
    from kohakumoss.adapters import casts
    from kohakumoss.memory.offload import apply_activation_offload
    from test_memory import ENGINES

    engines = {**ENGINES, "offload": [lambda m: apply_activation_offload(m, "cpu")],
               "offload halves": [lambda m: apply_activation_offload(m, "cpu", halves=True)]}
    ref, ref_grads = _lora_step(*_lora_bf16())
    builds = []
    apply = casts._JoinedCast.apply
    monkeypatch.setattr(casts._JoinedCast, "apply", lambda *a: builds.append(a[1]) or apply(*a))
    model, aset = _lora_bf16(engines[engine])
    out, grads = _lora_step(model, aset)
    blocks = len(model.layers) + len(model.text_embedder.blocks)
    per_block = {"selective": 0, "offload": 4, "offload halves": 4}.get(engine, 2)
    assert len(builds) == per_block * blocks
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def test_a_loaded_files_factors_are_cast_together_and_come_off_with_it(tmp_path, monkeypatch):
    """A LoRA file loaded in bypass for inference (``load_adapter_file``) casts each block's
    factors together once per forward, with the one-by-one casts' output bit for bit;
    ``remove()`` takes the groups and the model's hook off with the adapter."""
    from kohakumoss.adapters import casts
    from kohakumoss.model.build import tiny_transformer
    from kohakumoss.model.dit import cast_model

    model, aset = _lora_bf16()
    path = save_lycoris(aset, tmp_path / "lora.safetensors", dtype=torch.float32)
    inputs = _batch(torch.float32)[0]
    builds = []
    apply = casts._JoinedCast.apply
    monkeypatch.setattr(casts._JoinedCast, "apply", lambda *a: builds.append(a[1]) or apply(*a))
    outs = []
    for grouped in (True, False):
        base = cast_model(tiny_transformer(), torch.bfloat16)
        handle = load_adapter_file(base, path, 0.8, "bypass")
        assert handle.cast_hook is not None and len(base._forward_pre_hooks) == 1
        if not grouped:
            casts.detach_cast_groups(handle.modules, handle.cast_hook)
        builds.clear()
        with torch.no_grad():
            outs.append(base(*inputs))
        blocks = len(base.layers) + len(base.text_embedder.blocks)
        assert len(builds) == (2 * blocks if grouped else 0)
        handle.remove()
        assert handle.cast_hook is None and not base._forward_pre_hooks
        assert not any("kmoss_casts" in m.__dict__ for m in handle.modules.values())
    assert torch.equal(outs[0], outs[1])


def _one_step_deltas(**adapter):
    """Each trained tensor's change over one AdamW step of the tiny model (same seed, same
    batch), with the adapter settings ``adapter``."""
    from kohakumoss.config import OptimConfig
    from kohakumoss.training.optim import build_optimizer

    torch.manual_seed(0)
    model = _model(torch.float32)
    aset = apply_adapters(model, _cfg("lora", preset="attn-mlp+text-refiner", train_norms=True, **adapter), 0)
    for lyco in aset.modules.values():  # a trained state: every factor gets a gradient
        torch.nn.init.normal_(lyco.lora_up.weight, std=0.02)
    before = {n: p.detach().clone() for n, p in aset.named_trainable()}
    opt = build_optimizer(aset.named_trainable(), OptimConfig(lr=1e-3, weight_decay=0.0), aset.lr_scale())
    inputs, _ = _batch()
    model(*inputs).square().mean().backward()
    opt.step()
    return {n: p.detach() - before[n] for n, p in aset.named_trainable()}, aset


def test_loraplus_and_the_group_rates_change_only_their_tensors_step():
    """One AdamW step: LoRA+ scales the up (B) factors' change by its ratio and leaves every
    other tensor's as it was; the text refiner's and the norms' rates scale theirs alone."""
    plain, aset = _one_step_deltas()
    plus, _ = _one_step_deltas(loraplus_ratio=4.0)
    grouped, _ = _one_step_deltas(lr_text_refiner=0.5, lr_norms=2.0)
    ups = [n for n in plain if n.endswith("lora_up.weight")]
    assert ups and any(aset.lr_group(n) == "text_refiner" for n in plain)
    assert any(aset.lr_group(n) == "norms" for n in plain)
    for n, d in plain.items():
        assert d.abs().max() > 0, n
        want = 4.0 * d if n in ups else d
        torch.testing.assert_close(plus[n], want, rtol=1e-4, atol=2e-7)  # the weights round at ~6e-8
        factor = {"text_refiner": 0.5, "norms": 2.0, "blocks": 1.0}[aset.lr_group(n)]
        torch.testing.assert_close(grouped[n], factor * d, rtol=1e-4, atol=2e-7)  # the weights round at ~6e-8
