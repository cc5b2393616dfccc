"""Transformer checkpoint formats (docs/model.md#reading-the-config-from-a-checkpoint, docs/checkpoint-layouts.md): config inference, the
official and ComfyUI layouts and their round trips, quantized ComfyUI files, clear errors,
and loading that builds on the meta device and materialises tensor by tensor."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kohakumoss.model import FLAVORS, DiTConfig, MOSSImageTransformer, build_layout, infer_config
from kohakumoss.formats.model_files import (CheckpointError, load_transformer, read_config,
                                          save_comfy, save_official)
from kohakumoss.formats.keys import PREFIXES, fuse_qkv, split_qkv
from kohakumoss.precision.quant import hadamard, quantize_fp8, quantize_int8
from kohakumoss.model.dit import FP32_MODULES

from conftest import ROOT

VECTORS = ROOT / "tests" / "data" / "vectors"
SMALL = DiTConfig(dim=64, depth=2, heads=2, ffn_dim=128, text_dim=32, latent_channels=16,
                  freq_dim=32, negative_skip_layers=())
WIDE = DiTConfig(dim=256, depth=2, heads=4, ffn_dim=512, text_dim=256, latent_channels=16,
                 freq_dim=32, negative_skip_layers=())  # ConvRot needs in_features % 256 == 0
INDEX = "diffusion_pytorch_model.safetensors.index.json"


def random_model(config: DiTConfig, seed: int = 0) -> MOSSImageTransformer:
    """Linear weights ~ N(0, 0.02), biases and norm weights perturbed so no two tensors agree."""
    g = torch.Generator().manual_seed(seed)
    model = MOSSImageTransformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(0.02 * noise if p.ndim == 2 else
                    1 + 0.1 * noise if "norm" in name else 0.01 * noise)
    return model


def shapes(sd) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in sd.items()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def assert_same_state(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def velocity(model: MOSSImageTransformer, seed: int = 1) -> torch.Tensor:
    c, g = model.config, torch.Generator().manual_seed(seed)
    layout = build_layout([(2, 3), (3, 2)], [4, 3])
    img = torch.randn(layout.n_img, c.latent_channels, generator=g)
    text = torch.randn(layout.n_txt, c.text_dim, generator=g)
    with torch.no_grad():
        return model(img, text, torch.tensor([0.3, 0.8]), layout)


@pytest.fixture(scope="module")
def small() -> MOSSImageTransformer:
    return random_model(SMALL)


@pytest.fixture(scope="module")
def wide() -> MOSSImageTransformer:
    return random_model(WIDE, seed=3)


# 1. config inference ----------------------------------------------------------------------

def test_infer_config_recovers_every_field(tmp_path):
    c = DiTConfig(dim=96, depth=3, heads=3, ffn_dim=160, text_dim=40, text_blocks=1,
                  latent_channels=12, freq_dim=34, rope_base=500.0, negative_skip_layers=())
    sd = random_model(c).state_dict()
    assert infer_config(shapes(sd), c.hf_config()) == c
    assert infer_config(shapes(sd)) == dataclasses.replace(c, rope_base=10000.0)
    # rope_base travels through a folder's config.json, not through a ComfyUI file
    assert read_config(save_official(sd, tmp_path / "t", c))[0] == c
    assert read_config(save_comfy(sd, tmp_path / "c.safetensors", c))[0].rope_base == 10000.0


def test_base_config_on_meta_device():
    base = FLAVORS["base"]
    with torch.device("meta"):
        model = MOSSImageTransformer(base)
    sd = model.state_dict()
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == base.num_params() == 5_082_308_608
    assert len(sd) == 462 and "rope.bands" not in sd
    assert len(fuse_qkv(sd)) == 378
    inferred = infer_config(shapes(sd))
    assert inferred == base and inferred.depth == 42 and inferred.negative_skip_layers == (22,)


# 2. round trips ---------------------------------------------------------------------------

def test_official_comfy_official_round_trip_is_bit_exact(tmp_path, small):
    first = save_official(small, tmp_path / "a", SMALL, dtype=None)
    model, info = load_transformer(first, dtype=torch.float32)
    assert info.layout == "official" and not info.fused_qkv
    comfy = save_comfy(model, tmp_path / "b.safetensors", SMALL, dtype=None)
    raw = load_file(str(comfy))
    assert "layers.1.proj.qkv.weight" in raw
    assert not [k for k in raw if re.match(r"layers\.\d+\.proj\.[qkv]\.weight$", k)]
    assert torch.equal(raw["layers.1.proj.qkv.weight"][64:128], small.layers[1].proj["k"].weight)
    model, info = load_transformer(comfy, dtype=torch.float32)
    assert info.layout == "comfy" and info.fused_qkv and info.prefix == ""
    second = save_official(model, tmp_path / "c", SMALL, dtype=None)
    assert_same_state(folder_tensors(first), folder_tensors(second))
    assert_same_state(model.state_dict(), small.state_dict())


def test_fuse_and_split_qkv_are_inverse(small):
    sd = small.state_dict()
    fused = fuse_qkv(sd)
    assert len(fused) == len(sd) - 2 * SMALL.depth
    assert_same_state(split_qkv(fused), sd)


# 3. variants ------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["", *PREFIXES])
def test_prefixed_comfy_files_load(tmp_path, small, prefix):
    path = save_comfy(small, tmp_path / "m.safetensors", SMALL, dtype=None, prefix=prefix)
    model, info = load_transformer(path, dtype=torch.float32)
    assert info.prefix == prefix
    assert_same_state(model.state_dict(), small.state_dict())


def test_sharded_folder_and_pipeline_root(tmp_path, small):
    folder = save_official(small, tmp_path / "pipe" / "transformer", SMALL, dtype=None,
                           max_shard_bytes=40_000)
    index = json.loads((folder / INDEX).read_text())
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == [f.name for f in shards]
    for path in (folder, tmp_path / "pipe"):
        model, info = load_transformer(path, dtype=torch.float32)
        assert info.files == shards
        assert_same_state(model.state_dict(), small.state_dict())


def test_single_file_folder_without_index(tmp_path, small):
    c = dataclasses.replace(SMALL, rope_base=300.0)
    folder = tmp_path / "transformer"
    folder.mkdir()
    save_file(small.state_dict(), str(folder / "diffusion_pytorch_model.safetensors"))
    (folder / "config.json").write_text(json.dumps(c.hf_config()))
    model, info = load_transformer(tmp_path, dtype=torch.float32)
    assert info.config == c and len(info.files) == 1
    assert_same_state(model.state_dict(), small.state_dict())


def test_files_with_and_without_rope_bands(tmp_path, small):
    path = save_comfy(small, tmp_path / "with.safetensors", SMALL, dtype=None)
    raw = load_file(str(path))
    assert raw.pop("rope.bands").dtype == torch.float32
    save_file(raw, str(tmp_path / "without.safetensors"))
    for name in ("with", "without"):
        model, _ = load_transformer(tmp_path / f"{name}.safetensors", dtype=torch.float32)
        assert_same_state(model.state_dict(), small.state_dict())


def test_public_vectors_official_and_comfy_agree():
    official, info_o = load_transformer(VECTORS / "weights_official.safetensors", dtype=torch.float32)
    comfy, info_c = load_transformer(VECTORS / "weights_comfy.safetensors", dtype=torch.float32)
    assert info_o.config == info_c.config == FLAVORS["tiny"]
    assert info_c.fused_qkv and not info_o.fused_qkv
    assert_same_state(official.state_dict(), comfy.state_dict())


# 4. quantized ComfyUI files ---------------------------------------------------------------

def expected_quantized(config: DiTConfig) -> set[str]:
    names = {"text_embedder.proj.weight"}
    for i in range(config.text_blocks):
        names |= {f"text_embedder.blocks.{i}.{x}.weight"
                  for x in ("qkv", "proj", "ffn_gate", "ffn_up", "ffn_down")}
    for n in range(config.depth):
        names |= {f"layers.{n}.proj.{x}.weight" for x in ("q", "k", "v", "o", "ffn_up_gate", "ffn_down")}
    return names


@pytest.mark.parametrize("quantize, weight_tol, out_tol, codes", [
    ("int8_convrot", 1e-2, 5e-3, torch.int8),
    ("int8", 1e-2, 5e-3, torch.int8),
    ("fp8", 6e-2, 2e-2, torch.float8_e4m3fn),
])
def test_quantized_comfy_files_load(tmp_path, wide, quantize, weight_tol, out_tol, codes):
    path = save_comfy(wide, tmp_path / "q.safetensors", WIDE, dtype=None, quantize=quantize,
                      prefix="model.diffusion_model.")
    model, info = load_transformer(path, dtype=torch.float32)
    assert info.layout == "comfy-quantized" and info.fused_qkv
    assert set(info.quantized) == expected_quantized(WIDE)
    ref = wide.state_dict()
    for name, t in model.state_dict().items():
        q = info.reader.quantized(name)
        if name in info.quantized:
            assert q.codes.dtype == codes and q.convrot_group == (256 if quantize == "int8_convrot" else 0)
            assert 0 < rel(t, ref[name]) < weight_tol, name
        else:
            assert q is None and torch.equal(t, ref[name]), name
    assert rel(velocity(model), velocity(wide)) < out_tol


@pytest.mark.parametrize("group", [0, 256])
def test_fused_qkv_quantized_rows_split_into_thirds(tmp_path, wide, group):
    quantize = "int8_convrot" if group else "int8"
    path = save_comfy(wide, tmp_path / "q.safetensors", WIDE, dtype=None, quantize=quantize)
    _, info = load_transformer(path, dtype=torch.float32)
    raw = load_file(str(path))
    assert raw["layers.1.proj.qkv.weight_scale"].shape == (3 * WIDE.dim, 1)
    for part, x in enumerate("qkv"):
        q = info.reader.quantized(f"layers.1.proj.{x}.weight")
        rows = slice(part * WIDE.dim, (part + 1) * WIDE.dim)
        assert torch.equal(q.codes, raw["layers.1.proj.qkv.weight"][rows])
        assert torch.equal(q.scale.reshape(-1), raw["layers.1.proj.qkv.weight_scale"][rows].reshape(-1))
        # per-row quantization is row-local: the third equals quantizing the part alone
        codes, scale, _ = quantize_int8(wide.layers[1].proj[x].weight, group)
        assert torch.equal(q.codes, codes) and torch.equal(q.scale.reshape(-1), scale.reshape(-1))


def test_convrot_hadamard_and_inverse_rotation(tmp_path, wide):
    h = hadamard(256)
    assert torch.equal(h, h.T)
    assert torch.allclose(h @ h, torch.eye(256), atol=1e-5)
    assert set((h * 16).unique().tolist()) == {-1.0, 1.0}  # +-1 / sqrt(256)
    with pytest.raises(ValueError, match="power of 4"):
        hadamard(8)
    path = save_comfy(wide, tmp_path / "q.safetensors", WIDE, quantize="int8_convrot")
    _, info = load_transformer(path, dtype=torch.float32)
    w = wide.layers[0].proj["o"].weight
    q = info.reader.quantized("layers.0.proj.o.weight")
    assert rel(q.dequantize(), w) < 1e-2
    assert rel(dataclasses.replace(q, convrot_group=0).dequantize(), w) > 0.5


def test_legacy_scaled_fp8_file_loads(tmp_path, small):
    prefix, sd, out = "model.diffusion_model.", fuse_qkv(small.state_dict()), {}
    for k, v in sd.items():
        if k.startswith("layers.") and v.ndim == 2:
            codes, scale, _ = quantize_fp8(v)
            out[prefix + k], out[prefix + k.replace(".weight", ".scale_weight")] = codes, scale
        else:
            out[prefix + k] = v
    out[prefix + "scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    save_file(out, str(tmp_path / "legacy.safetensors"))
    model, info = load_transformer(tmp_path / "legacy.safetensors", dtype=torch.float32)
    assert info.layout == "comfy-quantized" and len(info.quantized) == 6 * SMALL.depth
    ref = small.state_dict()
    for name, t in model.state_dict().items():
        assert rel(t, ref[name]) < (6e-2 if name in info.quantized else 1e-12), name


# 5. errors --------------------------------------------------------------------------------

def _two_files(tmp_path, small):
    save_comfy(small, tmp_path / "d" / "a.safetensors", SMALL)
    shutil.copy(tmp_path / "d" / "a.safetensors", tmp_path / "d" / "b.safetensors")
    return tmp_path / "d", "2 .safetensors files and no " + INDEX


def _missing_shard(tmp_path, small):
    folder = save_official(small, tmp_path / "d", SMALL, max_shard_bytes=20_000)
    victim = sorted(folder.glob("*.safetensors"))[1]
    victim.unlink()
    return folder, f"names shards that are missing: {victim.name}"


def _written(path: Path, data: bytes, needle: str):
    path.write_bytes(data)
    return path, needle


def _edited(tmp_path, small, edit, needle):
    sd = fuse_qkv(small.state_dict())
    edit(sd)
    save_file(sd, str(tmp_path / "m.safetensors"))
    return tmp_path / "m.safetensors", needle


ERRORS = {
    "missing path": lambda t, s: (t / "nope", "nope does not exist"),
    "not safetensors": lambda t, s: _written(t / "m.pt", b"x", "m.pt is not a .safetensors file"),
    "corrupt file": lambda t, s: _written(t / "m.safetensors", b"garbage bytes",
                                          "m.safetensors is not a readable safetensors file"),
    "empty folder": lambda t, s: (t, "holds no .safetensors file"),
    "two files": _two_files,
    "missing shard": _missing_shard,
    "missing key": lambda t, s: _edited(t, s, lambda sd: sd.pop("layers.1.norm2.weight"),
                                        "missing 1 keys (e.g. layers.1.norm2.weight)"),
    "unknown key": lambda t, s: _edited(t, s, lambda sd: sd.update(extra=torch.ones(2)),
                                        "1 unknown keys (e.g. extra)"),
    "not a transformer": lambda t, s: _edited(t, s, lambda sd: sd.pop("shared_block_modulation.weight"),
                                              "m.safetensors: not a MOSS-Image transformer checkpoint: "
                                              "missing shared_block_modulation.weight"),
    "wrong shape": lambda t, s: _edited(t, s, lambda sd: sd.update({"layers.1.proj.o.weight": torch.ones(64, 8)}),
                                        "layers.1.proj.o.weight has shape (64, 8), expected (64, 64)"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_checkpoints_raise_clear_errors(tmp_path, small, case):
    path, needle = ERRORS[case](tmp_path, small)
    with pytest.raises(ValueError) as e:
        load_transformer(path)
    assert needle in str(e.value) and path.name in str(e.value)
    # the strict key check is a plain ValueError (keys.py); everything else a CheckpointError
    assert isinstance(e.value, CheckpointError) or case in ("missing key", "unknown key")


# 6. loading: meta build, tensor-by-tensor materialisation, dtypes --------------------------

def test_load_bf16_keeps_fp32_modules_and_derived_rope(tmp_path, small):
    c = dataclasses.replace(SMALL, rope_base=500.0)
    model, info = load_transformer(save_official(small, tmp_path / "t", c), dtype=torch.bfloat16)
    assert info.config == c
    for name, p in model.named_parameters():
        assert not p.is_meta and p.device.type == "cpu", name
        assert p.dtype == (torch.float32 if name.startswith(FP32_MODULES) else torch.bfloat16), name
    assert not any(b.is_meta for b in model.buffers())
    nb = c.rope_bands
    want = torch.reciprocal(torch.pow(torch.tensor(500.0), torch.arange(nb, dtype=torch.float32) / nb))
    assert model.rope.bands.dtype == torch.float32 and torch.equal(model.rope.bands, want)
    assert torch.isfinite(velocity(model)).all()


def test_loaded_parameters_own_their_storage(tmp_path, small):
    # split fused qkv parts must not keep the whole [3D, D] tensor alive (one copy of the model)
    path = save_comfy(small, tmp_path / "m.safetensors", SMALL, dtype=torch.float32)
    model, _ = load_transformer(path, dtype=torch.float32)
    for name, p in model.named_parameters():
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), name


def test_a_checkpoints_trained_record_is_checked_like_params():
    """``state.json``'s ``trained`` builds its ``AdapterConfig`` through the params checks: a
    damaged or foreign record is a clear error naming the field, never a half-built config."""
    from kohakumoss.config import AdapterConfig
    from kohakumoss.formats.trained import TrainedError, trained_config

    good = {"algo": "lora", "preset": "attn-mlp", "targets": [], "dim": 8, "alpha": 4.0,
            "dora": False, "algo_kwargs": {}, "train_norms": False}
    assert trained_config(good) == AdapterConfig(algo="lora", dim=8, alpha=4.0)
    assert trained_config({"algo": "full"}).full
    for bad, words in [({**good, "dim": -3}, ["trained.dim", "-3"]),
                       ({**good, "algo": "lorax"}, ["trained.algo", "lorax"]),
                       ({**good, "rank": 8}, ["trained.rank", "unknown key"])]:
        with pytest.raises(TrainedError) as e:
            trained_config(bad, "ckpt/step-000004")
        assert all(w in str(e.value) for w in ["ckpt/step-000004", *words]), str(e.value)
