"""A quantized frozen base (``precision.base: int8 | fp8``, ``precision.fp8_compute``;
``kohakumoss/quant/linear.py``, docs/precision.md#quantized-bases): the model and its
adapter's gradients against the same model holding the dequantized weights, ComfyUI files'
codes used as stored (ConvRot included), the knobs' refusals, the estimator's weight bytes
at the published size, and a tiny run that trains the unquantized run's curve."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from kohakumoss.quant import ops as quant_ops
from kohakumoss.adapters import apply_adapters
from kohakumoss.config import AdapterConfig
from kohakumoss.configlib import ConfigError
from kohakumoss.formats import load_dit
from kohakumoss.formats.model_files import save_comfy, stored_weights
from kohakumoss.model import FLAVORS
from kohakumoss.model.build import tiny_transformer
from kohakumoss.params import load_params
from kohakumoss.memory.profiles import PROFILE_ENGINES
from kohakumoss.quant.linear import (QuantizedLinear, quantizable, quantize_base, quantize_rows,
                                     quantized_ops, stored_rows)
from kohakumoss.precision.quant import QuantizedWeight
from kohakumoss.model import ops
from kohakumoss.training.engines import engine_plan
from kohakumoss.training.estimate import estimate

from test_checkpoints import WIDE, random_model
from test_kernel_backends import _graph
from test_fp16 import _inputs, _run, data  # noqa: F401  (the module's training data fixture)
from test_train import _write_params


def _dequantized_twin(qm) -> torch.nn.Module:
    """A plain tiny model holding ``qm``'s dequantized weights."""
    twin = tiny_transformer()
    with torch.no_grad():
        for path, lin in quantizable(twin):
            lin.weight.copy_(qm.get_submodule(path).weight)
    return twin


def _forward_and_grads(model):
    aset = apply_adapters(model, AdapterConfig(algo="lora", dim=4, alpha=4.0), seed=0)
    with torch.no_grad():
        for p in aset.trainable_parameters():
            p.add_(0.05)  # a LoRA whose up matrices are not zero: every gradient flows
    out = model(*_inputs())
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in aset.trainable_parameters()]


@pytest.mark.parametrize("base", ["int8", "fp8"])
def test_a_quantized_base_is_the_model_of_its_dequantized_weights(base):
    """fp32, reference ops: output and LoRA gradients the twin's up to fp32 round-off (the
    twin's plain linears fold their LoRA into one node, ``adapters/folded.py``, which sums
    the base and the delta in another order than a quantized linear's ``addmm``)."""
    qm = tiny_transformer()
    account = quantize_base(qm, base)
    assert "28 block linears" in account
    assert all(isinstance(qm.get_submodule(path), QuantizedLinear) for path, _ in quantizable(tiny_transformer()))
    assert qm.layers[0].proj["q"].codes.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[base]
    twin = _dequantized_twin(qm)
    (out, grads), (want, want_grads) = _forward_and_grads(qm), _forward_and_grads(twin)
    # each LoRA delta accumulated in place onto its quantized linear's own output, not onto
    # a view of it (autograd would copy the whole gradient back through CopySlices)
    assert "CopySlices" not in _graph(qm(*_inputs())) and "AddmmBackward0" in _graph(qm(*_inputs()))
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6 * b.abs().max()) for a, b in zip(grads, want_grads))
    # and the quantization itself is close to the original weights (per-row scales)
    err = {"int8": 1e-2, "fp8": 4e-2}[base]
    for (_, lin), (_, orig) in zip(quantizable(twin), quantizable(tiny_transformer())):
        assert (lin.weight - orig.weight).norm() <= err * orig.weight.norm()


def test_fp8_compute_reference_stays_near_the_weight_only_model():
    """fp8 activations (e4m3, per row) cost a few percent; the input gradient is the
    dequantized weight's, so the LoRA gradients stay close to the weight-only model's."""
    fp8c, wo = tiny_transformer(), tiny_transformer()
    quantize_base(fp8c, "fp8", fp8_compute=True)
    quantize_base(wo, "fp8")
    (out, grads), (want, want_grads) = _forward_and_grads(fp8c), _forward_and_grads(wo)
    assert not torch.equal(out, want)  # the activations were quantized
    assert (out - want).norm() <= 0.1 * want.norm()
    for a, b in zip(grads, want_grads):
        assert (a - b).norm() <= 0.2 * b.norm() + 1e-8
    with pytest.raises(ValueError, match="precision.base: fp8"):
        quantize_base(tiny_transformer(), "int8", fp8_compute=True)


def test_fp8_compute_full_moves_the_lora_product_and_the_gradients_by_e4m3():
    """``fp8_compute: full``: the LoRAs' forward products are summed in the fp8 GEMMs (e4m3
    factors) and the input gradients are fp8 products (``dy`` times the weight's row scales,
    e4m3 per row), so the output and the LoRA gradients move from ``on``'s by e4m3's
    rounding and no more."""
    full, on = tiny_transformer(), tiny_transformer()
    assert "input gradients too" in quantize_base(full, "fp8", fp8_compute=True, fp8_grad=True)
    quantize_base(on, "fp8", fp8_compute=True)
    assert "input gradient" in repr(full.layers[0].proj["q"]) and full.layers[0].proj["q"].fp8_grad
    (out, grads), (want, want_grads) = _forward_and_grads(full), _forward_and_grads(on)
    assert not torch.equal(out, want) and (out - want).norm() <= 5e-2 * want.norm()
    assert any(not torch.equal(a, b) for a, b in zip(grads, want_grads))
    for a, b in zip(grads, want_grads):  # 0.15: this LoRA (every factor + 0.05) outweighs the
        assert (a - b).norm() <= 0.15 * b.norm() + 1e-8  # base, and its e4m3 row sets x's scale
    # the op alone: the input gradient within e4m3's rounding of the exact one, fp32
    g = torch.Generator().manual_seed(3)
    codes, scale = quantize_rows(torch.randn(24, 40, generator=g) * 0.05, "fp8")
    x = torch.randn(9, 40, generator=g, requires_grad=True)
    dy = torch.randn(9, 24, generator=g)
    quant_ops.fp8_linear(x, codes, scale, None, True).backward(dy)
    exact = dy @ quant_ops.dequantize_rows(codes, scale, torch.float32)
    err = ((x.grad - exact).norm() / exact.norm()).item()
    assert 1e-4 < err < 6e-2


@pytest.mark.parametrize("full", [False, True], ids=["on", "full"])
def test_a_lora_on_fp8_compute_is_one_node_with_its_linear(full, monkeypatch):
    """A LoRA on an fp8-compute linear runs with it as one node (``fp8_lora_linears``); q, k
    and v as one: the same output and LoRA gradients as the separate nodes (the base op,
    then the delta accumulated onto it) up to fp32 round-off; with ``full`` the LoRA's
    product rides in the fp8 GEMM and the three input gradients of q, k and v are quantized
    as one row, within e4m3's rounding of the separate nodes."""
    calls = []

    def counted(model):
        inner = quantized_ops(model).fp8_lora_linears
        quantized_ops(model).override("fp8_lora_linears",
                           lambda x, layers, *rest: calls.append(len(layers)) or inner(x, layers, *rest))
        return model

    one, apart = tiny_transformer(), tiny_transformer()
    for m in (one, apart):
        quantize_base(m, "fp8", fp8_compute=True, fp8_grad=full)
    (out, grads) = _forward_and_grads(counted(one))
    # per joint block q, k and v as one call, then o, up|gate and down (the text refiner's
    # linears have biases: their LoRAs stay separate nodes)
    assert calls == [3, 1, 1, 1] * len(one.layers)
    monkeypatch.setattr(QuantizedLinear, "lora_op", lambda self: None)
    want, want_grads = _forward_and_grads(apart)
    if full:
        assert (out - want).norm() <= 5e-2 * want.norm()
    else:
        assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)
    tol = 0.15 if full else 1e-4  # full: e4m3 LoRA products and input gradients (see above)
    for a, b in zip(grads, want_grads):
        assert (a - b).norm() <= tol * b.norm() + 1e-8


def test_full_holds_each_nodes_codes_beside_their_slot():
    """With ``full``, the first forward of a LoRA node holds each linear's codes beside the
    node's slot columns (``QuantizedLinear.hold_slots``: q, k and v with rank 4 each, 16
    columns; o, up|gate and down alone, 16), once: the codes, the weight and the model's
    output are unchanged, and a cast of the model keeps the held codes as they are."""
    model = tiny_transformer()
    quantize_base(model, "fp8", fp8_compute=True, fp8_grad=True)
    block = model.layers[0].proj
    before = {n: block[n].codes.clone() for n in ("q", "o")}
    weight = block["q"].weight
    out, _ = _forward_and_grads(model)
    for name in ("q", "k", "v", "o"):
        lin = block[name]
        assert lin.codes.stride() == (lin.in_features + 16, 1), name
    for name, c in before.items():
        assert torch.equal(block[name].codes.view(torch.uint8), c.view(torch.uint8))
    assert torch.equal(block["q"].weight, weight)
    held = block["q"].codes
    assert torch.equal(model(*_inputs()), out)  # the held codes' forward: the same
    assert block["q"].codes is held  # held once
    block["q"].hold_slots(32)  # another node width: held again, the codes the same
    assert block["q"].codes.stride() == (block["q"].in_features + 32, 1)
    assert torch.equal(block["q"].codes.view(torch.uint8), before["q"].view(torch.uint8))
    model.to(torch.bfloat16)
    assert block["q"].codes.dtype == torch.float8_e4m3fn and block["q"].codes.stride()[0] == block["q"].in_features + 32


def test_kept_transposes_are_each_nodes_codes_transposed_once(monkeypatch):
    """``memory.fp8_transposes`` (``keep_fp8_transposes``): the first forward of each LoRA node
    makes its codes' transposes side by side with its slot columns (q, k and v: one buffer,
    held by q), the node's op receives them, a second step reuses them, other codes get new
    ones, and a forward without gradients makes none."""
    from kohakumoss.quant.linear import keep_fp8_transposes

    model = tiny_transformer()
    quantize_base(model, "fp8", fp8_compute=True, fp8_grad=True)
    assert keep_fp8_transposes(model) == 6 * len(model.layers)  # q, k, v, o, up|gate, down
    got = []
    inner = quantized_ops(model).fp8_lora_linears
    quantized_ops(model).override("fp8_lora_linears",
                       lambda x, layers, *rest: got.append(rest[2]) or inner(x, layers, *rest))
    out, _ = _forward_and_grads(model)
    block = model.layers[0].proj
    held = block["q"]._held_t[2]
    assert got[0] is held and len(got) == 4 * len(model.layers)
    q, k, v = (block[n].codes.view(torch.uint8) for n in ("q", "k", "v"))
    assert held.shape == (64, 3 * 64 + 16) and held.dtype == torch.float8_e4m3fn
    assert torch.equal(held.view(torch.uint8)[:, :192], torch.cat([q.t(), k.t(), v.t()], 1))
    assert block["k"]._held_t is None and block["o"]._held_t is not None
    model(*_inputs())
    assert block["q"]._held_t[2] is held  # kept between steps
    block["q"].hold_slots(48)  # other codes (a node of another width): made again
    model(*_inputs())
    assert block["q"]._held_t[2] is not held
    plain = tiny_transformer()
    quantize_base(plain, "fp8", fp8_compute=True, fp8_grad=True)
    want, _ = _forward_and_grads(plain)
    assert torch.equal(out, want)
    preview = tiny_transformer()  # a forward without gradients (a preview) has no backward
    quantize_base(preview, "fp8", fp8_compute=True, fp8_grad=True)
    keep_fp8_transposes(preview)
    apply_adapters(preview, AdapterConfig(algo="lora", dim=4, alpha=4.0), seed=0)
    with torch.no_grad():
        preview(*_inputs())
    assert all(m._held_t is None for m in preview.modules() if isinstance(m, QuantizedLinear))


def test_the_engines_set_the_kept_transposes_where_fp8_full_runs():
    """``apply_engines`` marks the fp8 LoRA linears under engines with ``fp8_transposes`` and
    fp8 compute ``full``; not with ``on``, nor under engines without it."""
    from kohakumoss.memory.profiles import MemoryEngines
    from kohakumoss.precision import precision_policy
    from kohakumoss.training.engines import EnginePlan, apply_engines

    def marked(memory, grad: bool) -> list[bool]:
        model = tiny_transformer()
        policy = precision_policy("bf16", full=False, base="fp8", fp8_compute=True, fp8_grad=grad)
        apply_engines(model, EnginePlan(torch.device("cpu"), policy, memory=memory))
        return [m.keep_transposes for m in model.modules() if isinstance(m, QuantizedLinear) and m.bias is None]

    assert all(marked(PROFILE_ENGINES["speed"], True)) and len(marked(PROFILE_ENGINES["speed"], True)) == 18
    assert not any(marked(PROFILE_ENGINES["speed"], False))
    assert not any(marked(MemoryEngines("none"), True))


def test_codes_and_scales_keep_their_dtypes_and_the_weight_is_read_only():
    qm = tiny_transformer()
    quantize_base(qm, "fp8")
    qm.to(torch.bfloat16)
    lin = qm.layers[0].proj["q"]
    assert lin.codes.dtype == torch.float8_e4m3fn and lin.scale.dtype == torch.float32
    assert lin.weight.dtype == torch.float32  # the dtype the base was quantized from
    with pytest.raises(AttributeError, match="held quantized"):
        lin.weight = torch.nn.Parameter(torch.zeros(2))
    aset = apply_adapters(qm.float(), AdapterConfig(algo="lora", dim=4, alpha=4.0), seed=0)
    with pytest.raises(RuntimeError, match="held quantized and cannot be merged"):
        aset.merge(1.0)


@pytest.mark.parametrize("fmt,base", [("int8_convrot", "int8"), ("int8", "int8"), ("fp8", "fp8")])
def test_comfy_quantized_files_are_used_as_stored(tmp_path, fmt, base):
    """A ComfyUI file's codes are the layer's (a tensor-wise scale becomes one per row);
    ConvRot's rotation moves to the layer's input: the forward is the dequantized model's."""
    path = save_comfy(random_model(WIDE).state_dict(), tmp_path / "q.safetensors", WIDE,
                      dtype=None, quantize=fmt)
    plain = load_dit(str(path), torch.float32, "cpu")  # dequantized on load
    qm = load_dit(str(path), torch.float32, "cpu")
    stored = stored_weights(str(path))
    account = quantize_base(qm, base, stored=stored)
    assert "taken from the checkpoint as stored" in account
    lin = qm.layers[1].proj["ffn_down"]
    file_codes = stored("layers.1.proj.ffn_down.weight").codes
    assert torch.equal(lin.codes.view(torch.uint8), file_codes.view(torch.uint8))
    assert lin.group == (256 if fmt == "int8_convrot" else 0)
    torch.testing.assert_close(lin.weight, plain.layers[1].proj["ffn_down"].weight, rtol=1e-5, atol=1e-6)
    img, txt, sigma, layout = _inputs(WIDE)
    with torch.no_grad():
        torch.testing.assert_close(qm(img, txt, sigma, layout), plain(img, txt, sigma, layout),
                                   rtol=1e-4, atol=1e-5)
    assert stored_weights("tiny") is None


def test_stored_scales_are_made_positive_or_not_taken():
    """A file's zero scale (an all-zero row) is taken as scale 1 over zero codes, the same
    weight with every scale positive (an fp8 linear's LoRA divides by them); a negative scale
    makes the layer quantized again from the loaded weight (None)."""
    codes, scale = quantize_rows(torch.randn(4, 16, generator=torch.Generator().manual_seed(0)), "fp8")
    scale[1] = 0
    got_codes, got_scale, _ = stored_rows(QuantizedWeight(codes, scale, "float8_e4m3fn"), "fp8")
    assert got_scale[1] == 1 and not got_codes[1].float().any() and (got_scale > 0).all()
    assert torch.equal(quant_ops.dequantize_rows(got_codes, got_scale, torch.float32),
                       quant_ops.dequantize_rows(codes, scale, torch.float32))
    assert codes[1].float().any()  # the file's codes are left as they are
    scale[2] = -scale[2]
    assert stored_rows(QuantizedWeight(codes, scale, "float8_e4m3fn"), "fp8") is None


def test_the_knobs_are_refused_where_they_cannot_work(tmp_path):
    def params(profile=None, **over):
        path = _write_params(tmp_path, tmp_path, **over)
        if profile:
            raw = yaml.safe_load(path.read_text())
            path.write_text(yaml.safe_dump({**raw, "profile": profile}))
        return path

    with pytest.raises(ConfigError, match="full finetune trains the base"):
        load_params(params(precision={"base": "int8"}, adapter={"algo": "full"}))
    with pytest.raises(ConfigError, match="does not stream yet"):
        load_params(params(precision={"base": "fp8"}, profile="minimal"))
    with pytest.raises(ConfigError, match="set precision.base: fp8"):
        load_params(params(precision={"base": "int8", "fp8_compute": "on"}))
    with pytest.raises(ConfigError, match="set train.dtype: bf16"):
        load_params(params(precision={"base": "fp8", "fp8_compute": "on"}))
    p = load_params(params(precision={"base": "fp8", "fp8_compute": "on"}, train={"dtype": "bf16"}))
    with pytest.raises(ConfigError, match="capability 8.9"):
        engine_plan(p, torch.device("cpu"))
    with pytest.raises(ConfigError, match="fp8_transposes.*set precision.fp8_compute: full"):
        load_params(params("manual", precision={"base": "fp8", "fp8_compute": "on"}, train={"dtype": "bf16"},
                           memory={"fp8_transposes": True}))
    load_params(params("manual", precision={"base": "fp8", "fp8_compute": "full"}, train={"dtype": "bf16"},
                       memory={"fp8_transposes": True}))
    with pytest.raises(ConfigError, match="fp8_compute: fast needs fp8 tensor cores"):
        engine_plan(load_params(params(precision={"base": "fp8", "fp8_compute": "fast"}, train={"dtype": "bf16"})),
                    torch.device("cpu"))


@pytest.mark.parametrize("knob", ["full", "fast"])
def test_fp8_compute_fast_is_full_with_its_gradients_accumulating_fast(knob, tmp_path, monkeypatch):
    """``precision.fp8_compute: fast`` is ``full`` (fp8 input gradients, the LoRA inside the
    GEMMs, kept transposes allowed) whose input gradients' GEMMs accumulate fast: the frozen
    base's fp8 ops are chosen from the ``scaled_mm_fast`` backends, ``full``'s from
    ``scaled_mm``."""
    from kohakumoss.kernels import KERNELS
    from kohakumoss.precision.policy import PrecisionPolicy
    from kohakumoss.training.engines import hold_quantized

    path = _write_params(tmp_path, tmp_path, precision={"base": "fp8", "fp8_compute": knob},
                         train={"dtype": "bf16"}, adapter={"algo": "lora", "dim": 4, "alpha": 4})
    monkeypatch.setattr(PrecisionPolicy, "check_device", lambda self, device: None)  # no sm89 here
    policy = engine_plan(load_params(path), torch.device("cpu")).precision
    assert policy.fp8_grad and policy.fp8_fast_grad == (knob == "fast")
    assert ("fast accumulation" in policy.describe()["base"]) == (knob == "fast")
    named, chosen = {}, KERNELS.chosen_op
    monkeypatch.setattr(KERNELS, "chosen_op", lambda op, device, dtype, names:
                        named.setdefault(op, list(names)) and chosen(op, device, dtype, names))
    model = tiny_transformer()
    hold_quantized(model, policy, torch.device("cpu"))
    want = ["scaled_mm_fast"] if knob == "fast" else ["scaled_mm"]
    assert named["fp8_linear"] == want and named["fp8_lora_linears"] == want
    assert named["quant_linear"] == ["dequant_mm", "triton"]
    assert all(isinstance(m, QuantizedLinear) and m.fp8_grad for m in model.layers[0].proj.values())


def test_the_estimate_holds_the_published_base_in_under_5_5_gib(tmp_path):
    """The published 5.08B transformer: its block linears in int8 or fp8 (codes and per-row
    scales) and the rest in bf16, against 9.5 GiB in bf16 (estimated on the meta device)."""
    batch = [(4096, 100)]
    frozen = {}
    for base in ("keep", "int8", "fp8"):
        path = _write_params(tmp_path, tmp_path, precision={"base": base}, train={"dtype": "bf16"},
                             adapter={"algo": "lora", "dim": 32, "alpha": 32})
        p = load_params(path)
        est = estimate(p, batch, engine_plan(p, torch.device("cpu")).memory, config=FLAVORS["base"])
        frozen[base] = est.weights
    assert frozen["keep"] > 9 * 2**30
    for base in ("int8", "fp8"):
        assert frozen[base] <= 5.5 * 2**30, frozen
        assert frozen[base] < 0.55 * frozen["keep"], frozen
    # fp8 compute full under speed keeps the codes' transposes: their bytes again (the joint
    # blocks' LoRA nodes; the text refiner's linears have biases and run apart)
    path = _write_params(tmp_path, tmp_path, precision={"base": "fp8", "fp8_compute": "full"},
                         train={"dtype": "bf16"}, adapter={"algo": "lora", "dim": 32, "alpha": 32})
    p = load_params(path)
    kept, made = (estimate(p, batch, dataclasses.replace(PROFILE_ENGINES["speed"], fp8_transposes=on),
                           config=FLAVORS["base"]).weights for on in (True, False))
    assert made == frozen["fp8"] and 4.4 * 2**30 < kept - made < 4.8 * 2**30


def test_a_tiny_int8_run_trains_the_unquantized_curve(data):  # noqa: F811
    tmp, ds = data
    _, keep = _run(tmp, ds, "keep", train={"steps": 6, "checkpoint_every": 6})
    trainer, q = _run(tmp, ds, "int8", train={"steps": 6, "checkpoint_every": 6},
                      precision={"base": "int8"})
    assert "int8 weight-only" in trainer.components.applied.quantized
    assert isinstance(trainer.model.layers[0].proj["q"], QuantizedLinear)  # LyCORIS wraps its forward
    for a, b in zip(q.losses, keep.losses):
        assert abs(a - b) <= 2e-2 * abs(b), (q.losses, keep.losses)


def test_sampling_holds_the_base_as_training_does(tmp_path):
    """``kmoss sample`` / ``grid`` on ``precision.base: int8``: the codes held, an adapter file
    run beside the quantized layers (merging into codes is refused), images near the bf16
    base's; ``fp8_compute`` on a CPU is refused with the reason."""
    import numpy as np

    from kohakumoss.formats.lycoris import save_lycoris
    from kohakumoss.generate import Generator, Settings

    from conftest import make_params

    def params(**precision):
        return make_params([{"source": "kohya", "path": str(tmp_path)}], precision=precision,
                           encoders={"device": "cpu", "text_dtype": "fp32", "vae_dtype": "fp32"})

    aset = apply_adapters(tiny_transformer(), AdapterConfig(algo="lora", dim=4, alpha=4.0), seed=0)
    with torch.no_grad():
        for p in aset.trainable_parameters():
            p.add_(0.05)
    lora = save_lycoris(aset, tmp_path / "lora.safetensors", dtype=torch.float32)
    s = Settings(width=32, height=32, steps=4)
    images = []
    for precision in ({}, {"base": "int8"}):
        gen = Generator(params(**precision), torch.device("cpu"), torch.float32, adapters=[f"{lora}:1.0"])
        images.append(np.asarray(gen.images(["kohaku, 2 red circles"], [0], s)[0], dtype=np.float64))
    assert isinstance(gen.model.layers[0].proj["q"], QuantizedLinear)
    assert np.abs(images[0] - images[1]).mean() < 3.0  # 8-bit levels: int8's rounding only
    gen.use([])  # the adapter taken off: it had changed the picture
    bare = np.asarray(gen.images(["kohaku, 2 red circles"], [0], s)[0], dtype=np.float64)
    assert np.abs(bare - images[1]).mean() > 3 * np.abs(images[0] - images[1]).mean()
    with pytest.raises(ConfigError, match="capability 8.9"):
        Generator(params(base="fp8", fp8_compute="on"), torch.device("cpu"), torch.bfloat16)


def test_auto_leaves_the_streamed_profiles_to_an_unquantized_base(tmp_path):
    """Free memory below what the leanest resident engines need: for a bf16 base auto takes
    a streamed profile; for an int8 base (which does not stream yet) it stays resident and
    says that nothing fits."""
    from kohakumoss.memory.profiles import MemoryEngines
    from kohakumoss.training.autoprofile import HEADROOM, resolve_profile

    def params(**precision):
        path = _write_params(tmp_path, tmp_path, adapter={"algo": "lora", "dim": 32, "alpha": 32},
                             train={"dtype": "bf16"}, precision=precision)
        raw = yaml.safe_load(path.read_text())
        path.write_text(yaml.safe_dump({**raw, "profile": "auto"}))
        return load_params(path)

    base, batch, cuda = FLAVORS["base"], [(4096, 104)], torch.device("cuda")
    int8 = params(base="int8")
    offloaded = estimate(int8, batch, MemoryEngines("sub-block", offload=True), config=base)
    free = int(offloaded.peak * 0.9 / HEADROOM)
    _, engines, _, _ = resolve_profile(params(), batch, cuda, free=free, config=base, host_free=64 * 2**30)
    assert engines.stream_slots  # bf16: streaming fits
    _, engines, _, why = resolve_profile(int8, batch, cuda, free=free, config=base, host_free=64 * 2**30)
    assert not engines.stream_slots and "nothing fits" in why, (engines, why)
    # with a little more room the int8 base's leanest resident engines fit: offloaded halves
    free = int(offloaded.peak * 1.01 / HEADROOM)
    _, engines, _, why = resolve_profile(int8, batch, cuda, free=free, config=base, host_free=64 * 2**30)
    assert engines == MemoryEngines("sub-block", offload=True), (engines, why)


@pytest.mark.parametrize("base", ["int8", "fp8"])
@pytest.mark.parametrize("halves", [False, True], ids=["block", "sub-block"])
def test_activation_offload_over_a_quantized_base_is_exact(base, halves):
    """Offload's recomputation (the attention replayed; the quantized tails run as they are:
    they keep only their inputs) gives the resident quantized model's output and LoRA
    gradients bit for bit."""
    from kohakumoss.memory.offload import apply_activation_offload

    plain, offloaded = tiny_transformer(), tiny_transformer()
    quantize_base(plain, base)
    quantize_base(offloaded, base)
    apply_activation_offload(offloaded, "cpu", halves=halves)
    (out, grads), (want, want_grads) = _forward_and_grads(offloaded), _forward_and_grads(plain)
    assert torch.equal(out, want) and offloaded.engines.state("activation offload").bytes > 0
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))
