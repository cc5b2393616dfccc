"""ComfyUI adapter export: every algorithm's comfy file, read through an independent
re-implementation of ComfyUI's loader (``comfy_semantics``), reproduces the trained merged
weights and the bypass output, on the split and the fused-q/k/v layout; the public LoRA
vectors convert to the reference's ComfyUI files."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kohakumoss.adapters import merged_weight
from kohakumoss.export.cases import trained_case
from kohakumoss.export.check import trained_deltas
from kohakumoss.formats.comfy import (comfy_from_weight_deltas, comfy_state_dict, convert_file,
                                      load_adapter_file, save_comfy_file)
from kohakumoss.formats.comfy_semantics import comfy_weight_deltas, verify
from kohakumoss.model import build_layout
from kohakumoss.model.build import tiny_transformer
from kohakumoss.formats.model_files import load_transformer
from kohakumoss.formats.keys import fuse_qkv, split_qkv
from kohakumoss.checks.parity import load_batch, rel_error

from conftest import ROOT

VECTORS = ROOT / "tests" / "data" / "vectors"
ALGOS = {"lora": {}, "locon": {}, "loha": {}, "lokr": {"algo_kwargs": {"factor": 4}}, "dora": {},
         "oft": {}, "boft": {"dim": 8}, "glora": {}, "ia3": {}, "dylora": {"dim": 8}, "tlora": {}}
VARIANTS = {
    "loha-dora": ("loha", {"dora": True}),
    "lokr-dora": ("lokr", {"dora": True, "algo_kwargs": {"factor": 4}}),
    "dora-input-axis": ("lora", {"dora": True, "algo_kwargs": {"wd_on_out": False}}),
    "lokr-full-factors": ("lokr", {"dim": 10000, "alpha": 1.0, "algo_kwargs": {"factor": 4}}),
    "oft-rescaled": ("oft", {"algo_kwargs": {"rescaled": True}}),
    "oft-constraint": ("oft", {"algo_kwargs": {"constraint": 1e-2}}),
    "boft-rescaled-constraint": ("boft", {"dim": 8,
                                          "algo_kwargs": {"rescaled": True, "constraint": 1e-2}}),
    "glora-scalar": ("glora", {"algo_kwargs": {"use_scalar": True}}),
    "ia3-on-input": ("ia3", {"algo_kwargs": {"train_on_input": True}}),
    "trained-norms": ("lora", {"train_norms": True}),
}
CASES = {**{a: (a, kw) for a, kw in ALGOS.items()}, **VARIANTS}
# a tensor the split file's layers.0.proj.q must hold: the native set, or a dense diff
MARK = {"loha": "hada_w1_a", "lokr": "lokr_w2_a", "oft": "oft_blocks", "boft": "oft_blocks",
        "glora": "a1.weight", "ia3": "diff", "dora": "dora_scale", "oft-rescaled": "diff",
        "lokr-full-factors": "lokr_w2", "loha-dora": "dora_scale", "lokr-dora": "dora_scale",
        "dora-input-axis": "dora_scale", "trained-norms": "lora_up.weight"}
TOL = 2e-6  # fp32 files: the trained merged weights to float32 rounding


def _inputs():
    g = torch.Generator().manual_seed(0)
    hw, lens = [(3, 4), (2, 2)], [5, 3]
    return (torch.randn(16, 128, generator=g), torch.randn(8, 48, generator=g),
            torch.tensor([0.3, 0.8]), build_layout(hw, lens))


def _base() -> torch.nn.Module:
    model = tiny_transformer().float().eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # non-zero biases, so bias deltas (IA3, OFT on biased layers) show
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _trained(algo: str, kw: dict):
    """A tiny DiT with the adapter on preset ``all``, every factor moved off its init."""
    return trained_case(algo, kw)


def _expected(aset, base: dict[str, torch.Tensor], fused: bool) -> dict[str, torch.Tensor]:
    """Trained merged weights minus the base, straight from ``runtime.merged_weight``."""
    out = {}
    for path, lyco in aset.modules.items():
        W, b = merged_weight(lyco, 1.0)
        out[f"{path}.weight"] = W - base[f"{path}.weight"]
        if b is not None and (db := b - base[f"{path}.bias"]).any():
            out[f"{path}.bias"] = db
    for path, n in aset.norms.items():
        out[f"{path}.weight"] = n.merged_weight(1.0) - base[f"{path}.weight"]
    if fused:
        full = {k: out.get(k, torch.zeros_like(v)) for k, v in base.items()}
        out = {k: v for k, v in fuse_qkv(full).items()
               if k in out or (k.endswith("proj.qkv.weight") and v.any())}
    return out


def _model_with(state: dict[str, torch.Tensor], fused: bool) -> torch.nn.Module:
    model = tiny_transformer().float().eval()
    model.load_state_dict(split_qkv(state) if fused else state)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_comfy_file_reproduces_trained_adapter(case, tmp_path):
    algo, kw = CASES[case]
    model, aset = _trained(algo, kw)
    x = _inputs()
    with torch.no_grad():
        y = model(*x)  # the trained adapter, bypass
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert rel_error(y, _model_with(base, False)(*x)) > 1e-3  # the adapter matters
    for fused in (False, True):
        tensors, meta = comfy_state_dict(aset, model, fused_qkv=fused, dtype=torch.float32,
                                         style="diffusion_model" if fused else "lora_unet")
        assert meta["kohakumoss_format"] == "comfy"
        assert meta["kohakumoss_fused_qkv"] == str(int(fused))
        layout = fuse_qkv(base) if fused else base
        deltas, unloaded = comfy_weight_deltas(tensors, layout)
        assert unloaded == [], (fused, unloaded[:4])
        want = _expected(aset, base, fused)
        assert sorted(deltas) == sorted(want), fused
        bad = {k: e for k in want if (e := rel_error(deltas[k], want[k])) > TOL}
        assert not bad, (fused, bad)
        state = {k: v + deltas[k] if k in deltas else v for k, v in layout.items()}
        with torch.no_grad():
            assert rel_error(_model_with(state, fused)(*x), y) <= TOL, fused
        rows, unloaded = verify(tensors, layout, trained_deltas(aset, fused))
        assert unloaded == [] and max(r.rel_error for r in rows) <= TOL
        if not fused:
            path = save_comfy_file(tmp_path / "split.safetensors", tensors, meta)
            q = {k.split(".", 1)[1] for k in tensors if k.startswith("lora_unet_layers_0_proj_q.")}
            assert MARK.get(case, MARK.get(algo, "lora_up.weight")) in q, q
    # q/k/v were fused: one layer per joint block, plain LoRA kinds stay LoRA
    qkv = [k for k in tensors if "layers.0.proj.qkv." in k]
    plain = algo in ("lora", "locon", "dylora", "tlora") and not kw.get("dora")
    assert {k.split("qkv.")[1] for k in qkv} == ({"lora_up.weight", "lora_down.weight", "alpha"}
                                                 if plain else {"diff"})
    # our own split comfy file, read back (comfy conversions undone) and rewritten fused
    fresh = _base()
    tensors, _ = convert_file(fresh, path, fused_qkv=True, dtype=torch.float32)
    assert all("forward" not in m.__dict__ for m in fresh.modules())
    deltas, unloaded = comfy_weight_deltas(tensors, fuse_qkv(base))
    want = _expected(aset, base, True)
    assert not unloaded and max(rel_error(deltas.get(k), want[k]) for k in want) <= TOL


def test_saved_file_metadata_and_our_loader_reads_it(tmp_path):
    model, aset = _trained("dora", {})
    x = _inputs()
    with torch.no_grad():
        y = model(*x)
    tensors, meta = comfy_state_dict(aset, model, fused_qkv=True, dtype=torch.float32,
                                     base_model="tiny", params_hash="abc")
    path = save_comfy_file(tmp_path / "a.safetensors", tensors, meta)
    with safe_open(str(path), "pt") as f:
        got = f.metadata()
    assert got["kohakumoss_params_hash"] == "abc" and got["kohakumoss_base_model"] == "tiny"
    assert got["kohakumoss_algo"] == "dora" and got["kohakumoss_rank"] == "4"
    assert got["ss_network_module"] == "lycoris.kohya"
    assert "weight_decompose" in got["ss_network_args"]
    fresh = _base()
    handle = load_adapter_file(fresh, path)  # the comfy conversions are undone on load
    with torch.no_grad():
        assert rel_error(fresh(*x), y) <= TOL
    handle.remove()
    bf16, _ = comfy_state_dict(aset, model)  # the factors bf16; the DoRA scales and alphas float32
    assert {k.rsplit(".", 1)[-1] for k, v in bf16.items() if v.dtype == torch.float32} == \
        {"dora_scale", "alpha"}
    factors = ("_up.weight", "_down.weight", ".diff")
    assert {v.dtype for k, v in bf16.items() if k.endswith(factors)} == {torch.bfloat16}


def test_dense_deltas_writer():
    model, aset = _trained("ia3", {})
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    deltas = {}
    for path, lyco in aset.modules.items():
        W, b = merged_weight(lyco, 1.0)
        deltas[path] = (W - base[f"{path}.weight"], None if b is None else b - base[f"{path}.bias"])
    for fused in (False, True):
        tensors = comfy_from_weight_deltas(deltas, fused_qkv=fused, dtype=torch.float32)
        got, unloaded = comfy_weight_deltas(tensors, fuse_qkv(base) if fused else base)
        want = _expected(aset, base, fused)
        assert not unloaded and sorted(got) == sorted(want)
        assert max(rel_error(got[k], want[k]) for k in want) <= TOL


def _vector_base():
    model, _ = load_transformer(VECTORS / "weights_official.safetensors", dtype=torch.float32)
    return model.eval(), {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("fused", [False, True])
def test_vector_lora_converts_to_the_reference_comfy_file(fused, tmp_path):
    model, base = _vector_base()
    layout = fuse_qkv(base) if fused else base
    tensors, meta = convert_file(model, VECTORS / "lora_lycoris.safetensors", fused_qkv=fused,
                                 dtype=torch.float32)
    assert meta["kohakumoss_algo"] == "lora" and meta["kohakumoss_fused_qkv"] == str(int(fused))
    assert all("forward" not in m.__dict__ for m in model.modules())  # the model is left as it was
    ref_file = "lora_comfy_fused_qkv" if fused else "lora_comfy"
    ours, unloaded = comfy_weight_deltas(tensors, layout)
    ref, ref_unloaded = comfy_weight_deltas(load_file(str(VECTORS / f"{ref_file}.safetensors")),
                                            layout)
    assert not unloaded and not ref_unloaded
    assert sorted(ours) == sorted(ref) and len(ref) == (12 if fused else 18)
    assert max(rel_error(ours[k], ref[k]) for k in ref) <= 1e-6
    if fused:  # and back: the fused conversion of the reference's fused file is the same again
        again, _ = convert_file(model, VECTORS / f"{ref_file}.safetensors", fused_qkv=True,
                                dtype=torch.float32)
        d2, _ = comfy_weight_deltas(again, layout)
        assert max(rel_error(d2[k], ref[k]) for k in ref) <= 1e-6


@pytest.mark.parametrize("name", ["lora_comfy", "lora_comfy_fused_qkv"])
def test_comfy_semantics_reproduces_vector_velocity(name):
    model, base = _vector_base()
    batch = load_batch(VECTORS)
    fused = "fused" in name
    layout = fuse_qkv(base) if fused else base
    deltas, unloaded = comfy_weight_deltas(load_file(str(VECTORS / f"{name}.safetensors")), layout)
    assert not unloaded
    state = {k: v + deltas[k] if k in deltas else v for k, v in layout.items()}
    model.load_state_dict(split_qkv(state) if fused else state)
    inputs = (batch["img"], batch["text"], batch["sigma"],
              build_layout(batch["hw"].tolist(), batch["text_len"].tolist()))
    with torch.no_grad():
        assert rel_error(model(*inputs), batch["v_lora_fp32"]) <= 1e-5


def test_unknown_stems_and_wrong_layouts_are_unloaded():
    _, base = _vector_base()
    sd = load_file(str(VECTORS / "lora_comfy.safetensors"))
    extra = {"lora_unet_layers_0_proj_zzz.lora_up.weight": torch.zeros(64, 4),
             "lora_unet_layers_0_proj_q.lora_sideways": torch.zeros(2)}
    deltas, unloaded = comfy_weight_deltas({**sd, **extra}, base)
    assert unloaded == sorted(extra) and len(deltas) == 18
    # the split-layout file on the fused layout: its q/k/v stems name no weight there
    deltas, unloaded = comfy_weight_deltas(sd, fuse_qkv(base))
    assert len(deltas) == 9 and len(unloaded) == 27 and all("_proj_q." in k or "_proj_k." in k
                                                             or "_proj_v." in k for k in unloaded)
    # a diff of the wrong shape is not merged; a bias delta on a bias-less layer is not loaded
    bad = {"diffusion_model.layers.0.proj.o.diff": torch.zeros(64, 63),
           "diffusion_model.layers.0.proj.ffn_down.diff": torch.zeros(64, 128),
           "diffusion_model.layers.0.proj.ffn_down.diff_b": torch.zeros(64)}
    deltas, unloaded = comfy_weight_deltas(bad, base)
    assert list(deltas) == ["layers.0.proj.ffn_down.weight"]
    assert unloaded == sorted(["diffusion_model.layers.0.proj.o.diff",
                               "diffusion_model.layers.0.proj.ffn_down.diff_b"])
