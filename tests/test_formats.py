"""Every external format round-trips through its module of ``kohakumoss.formats``: written, then
read back, it gives the same tensors under the same keys (docs/formats.md). The fused q/k/v
rule of ``formats.keys`` is the one every format uses. (The model files' own round trips,
prefixes and quantization are in test_checkpoints.py.)"""

from __future__ import annotations

import pytest
import torch

from kohakumoss.adapters import apply_adapters
from kohakumoss.config import AdapterConfig
from kohakumoss.formats import comfy, diffusers, keys, lycoris, merged
from kohakumoss.model.build import tiny_transformer

ALGOS = {"lora": {}, "loha": {}, "lokr": {"algo_kwargs": {"factor": 4}}, "oft": {},
         "oft-constraint": {"algo": "oft", "algo_kwargs": {"constraint": 1e-2}},
         "dora": {}, "tlora": {}, "ia3": {}, "norms": {"algo": "lora", "train_norms": True}}


def _trained(name: str, seed: int = 1):
    """A tiny float32 DiT with an adapter whose every tensor is moved off its init."""
    model = tiny_transformer().float().eval()
    kw = {"algo": name, "dim": 4, "alpha": 2.0, **ALGOS[name]}
    aset = apply_adapters(model, AdapterConfig(**kw), seed=0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in aset.named_trainable():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model, aset.eval()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# -- the fused q/k/v rule -------------------------------------------------------------------------
def test_the_fused_qkv_rule_and_its_state_dict_round_trip():
    assert keys.qkv_paths(3) == ["layers.3.proj.q", "layers.3.proj.k", "layers.3.proj.v"]
    assert keys.fused_path(3) == "layers.3.proj.qkv"
    assert [keys.qkv_layer(n) for n in ("layers.3.proj.k", "layers.3.proj.v.weight",
                                        "layers.3.proj.qkv", "layers.3.proj.o",
                                        "text_embedder.blocks.0.qkv")] == [3, 3, None, None, None]
    assert [keys.fused_layer(n) for n in ("layers.12.proj.qkv", "layers.12.proj.qkv.weight",
                                          "layers.12.proj.q", "text_embedder.blocks.0.qkv")] == \
        [12, 12, None, None]
    sd = tiny_transformer().state_dict()
    fused = keys.fuse_qkv(sd)
    depth = len(tiny_transformer().layers)
    assert [k for k in fused if "proj.q" in k or "proj.k." in k] == \
        [f"{keys.fused_path(n)}.weight" for n in range(depth)]
    for n in range(depth):
        assert torch.equal(fused[f"{keys.fused_path(n)}.weight"],
                           torch.cat([sd[k] for k in keys.qkv_parts(n)]))
    back = keys.split_qkv(fused)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


# -- LyCORIS --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(ALGOS))
def test_lycoris_file_round_trip(name, tmp_path):
    model, aset = _trained(name)
    path = lycoris.save_lycoris(aset, tmp_path / "a.safetensors", dtype=torch.float32,
                                metadata={"kohakumoss_step": "7"})
    written = lycoris.lycoris_state_dict(aset, torch.float32)
    sets, meta = lycoris.read_lycoris(path, tiny_transformer())
    read = {f"{lycoris.stem(p)}.{k}": v for p, t in sets.items() for k, v in t.items()}
    _same(read, written)
    assert meta["kohakumoss_format"] == "lycoris" and meta["kohakumoss_step"] == "7"
    assert meta["kohakumoss_algo"] == ALGOS[name].get("algo", name)
    assert sorted(sets) == sorted([*aset.modules, *aset.norms])
    # the key layout: LyCORIS's own module names, its own tensor names
    assert all(k.startswith("lora_unet_") and "." in k for k in read)
    if name == "lora":
        assert {k for k in read if k.startswith("lora_unet_layers_0_proj_q.")} == {
            "lora_unet_layers_0_proj_q.lora_up.weight", "lora_unet_layers_0_proj_q.lora_down.weight",
            "lora_unet_layers_0_proj_q.alpha"}


def test_every_stem_names_the_same_layer():
    paths = ["layers.0.proj.q", "text_embedder.proj"]
    index = lycoris.stem_index(paths)
    for path in paths:
        for style in lycoris.STYLES:
            assert index[lycoris.stem(path, style)] == path
        for prefix in keys.PREFIXES:
            assert index[prefix + path] == path
        assert index["lycoris_" + path.replace(".", "_")] == path
    with pytest.raises(ValueError, match="key style 'kohya'"):
        lycoris.stem("layers.0.proj.q", "kohya")


def test_a_key_of_no_layer_is_named(tmp_path):
    from safetensors.torch import save_file

    save_file({"lora_unet_layers_0_proj_zz.lora_up.weight": torch.zeros(2, 2)},
              str(tmp_path / "x.safetensors"))
    with pytest.raises(lycoris.AdapterFileError, match=r"x\.safetensors.*layers_0_proj_zz"):
        lycoris.read_lycoris(tmp_path / "x.safetensors", tiny_transformer())


# -- ComfyUI adapter files ------------------------------------------------------------------------
@pytest.mark.parametrize("style", lycoris.STYLES)
@pytest.mark.parametrize("name", ["lora", "loha", "lokr", "ia3", "norms"])
def test_comfy_split_file_round_trip(name, style, tmp_path):
    model, aset = _trained(name)
    tensors, meta = comfy.comfy_state_dict(aset, model, style=style, dtype=torch.float32)
    path = comfy.save_comfy_file(tmp_path / "c.safetensors", tensors, meta)
    sets, read_meta = comfy.read_comfy(path, tiny_transformer())
    assert read_meta == meta
    _same({f"{comfy.stem(p, style)}.{k}": v for p, t in sets.items() for k, v in t.items()},
          tensors)


@pytest.mark.parametrize("name", ["lora", "loha"])
def test_comfy_fused_file_reads_back_to_the_same_q_k_v_deltas(name, tmp_path):
    """Fused: one ``layers.N.proj.qkv`` set per joint block on disk, split back to q/k/v sets
    whose deltas are the written ones (LoRA: repacked factors; others: a dense diff)."""
    model, aset = _trained(name)
    tensors, meta = comfy.comfy_state_dict(aset, model, fused_qkv=True, dtype=torch.float32)
    fused_stems = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0]
                   for k in tensors if "proj_qkv" in k}
    assert fused_stems == {f"lora_unet_layers_{n}_proj_qkv" for n in range(len(model.layers))}
    assert not any(k.startswith(("lora_unet_layers_0_proj_q.", "lora_unet_layers_0_proj_k."))
                   for k in tensors)
    path = comfy.save_comfy_file(tmp_path / "f.safetensors", tensors, meta)
    sets, _ = comfy.read_comfy(path, tiny_transformer())
    for n in range(len(model.layers)):
        for path_, lyco in ((p, aset.modules[p]) for p in keys.qkv_paths(n)):
            want = comfy.layer_delta(lyco)[0]
            t = sets[path_]
            if name == "lora":
                got = t["lora_up.weight"] @ t["lora_down.weight"] * (float(t["alpha"])
                                                                      / t["lora_down.weight"].shape[0])
            else:
                got = t["diff"]
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), path_


@pytest.mark.parametrize("name", ["oft-constraint", "dora"])
def test_our_comfy_conversions_are_undone_on_load(name, tmp_path):
    """OFT's alpha (constraint x out rows) and DoRA's scale (ComfyUI's row norm) come back
    as LyCORIS's: the loaded file gives the trained output."""
    model, aset = _trained(name)
    x = (torch.randn(16, 128), torch.randn(8, 48), torch.tensor([0.3, 0.8]))
    from kohakumoss.model import build_layout

    x = (*x, build_layout([(3, 4), (2, 2)], [5, 3]))
    with torch.no_grad():
        y = model(*x)
    tensors, meta = comfy.comfy_state_dict(aset, model, dtype=torch.float32)
    path = comfy.save_comfy_file(tmp_path / "c.safetensors", tensors, meta)
    fresh = tiny_transformer().float().eval()
    handle = comfy.load_adapter_file(fresh, path)
    with torch.no_grad():
        assert torch.allclose(fresh(*x), y, rtol=1e-4, atol=1e-6)
    handle.remove()


# -- merged model file and diffusers folder -------------------------------------------------------
@pytest.mark.parametrize("fused", [True, False])
def test_merged_file_round_trip(fused, tmp_path):
    model, aset = _trained("loha")
    state = merged.merged_state(model, aset, 0.5)
    path = merged.save_merged(state, tmp_path / "m.safetensors", model.config, dtype=torch.float32,
                              fused_qkv=fused, strength=0.5, metadata={"kohakumoss_step": "3"})
    read, meta = merged.read_merged(path)
    _same(read, {k: v for k, v in state.items() if k != keys.ROPE_KEY})
    assert meta["kohakumoss_strength"] == "0.5" and meta["kohakumoss_step"] == "3"
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        on_disk = set(f.keys())
    assert ("layers.0.proj.qkv.weight" in on_disk) is fused
    assert ("layers.0.proj.q.weight" in on_disk) is not fused


def test_merged_state_leaves_the_model_as_it_was():
    model, aset = _trained("lokr")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    at_one = merged.merged_state(model, aset, 1.0)
    _same({k: v for k, v in model.state_dict().items()}, before)
    assert not torch.equal(at_one["layers.0.proj.q.weight"], before["layers.0.proj.q.weight"])
    _same(merged.merged_state(model), before)


def test_diffusers_folder_round_trip_and_whole_replacement(tmp_path):
    model, aset = _trained("lora")
    state = merged.merged_state(model, aset)
    folder = diffusers.save_diffusers(state, tmp_path / "d", model.config, dtype=torch.float32)
    read, config = diffusers.read_diffusers(folder)
    _same(read, {k: v for k, v in state.items() if k != keys.ROPE_KEY})
    assert config == model.config.hf_config()
    assert not any("qkv" in k and k.startswith("layers.") for k in read)
    (folder / "stale.txt").write_text("from an earlier export")
    again = diffusers.save_diffusers(state, folder, model.config, dtype=torch.bfloat16)
    assert not (again / "stale.txt").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    read, _ = diffusers.read_diffusers(again)
    assert read["layers.0.proj.q.weight"].dtype == torch.bfloat16
