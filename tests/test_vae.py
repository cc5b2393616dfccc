"""The frozen FLUX.2 VAE (docs/encoders.md#vae, docs/encoders.md#cache-keys): patchify
order, token packing, BatchNorm normalisation, posterior draws, batching, dtypes, and every
loading layout (diffusers folder / pipeline root, single file in diffusers or BFL/LDM naming,
prefixed, ComfyUI-quantized), all on the tiny in-code VAE."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kohakumoss.encoders import (VAE, VAEError, batch_groups, from_tokens, patchify, to_tokens,
                                 unpatchify)
from kohakumoss.encoders.vae import build_tiny
from kohakumoss.precision.quant import encode_format, quantize_fp8


@pytest.fixture(scope="module")
def vae() -> VAE:
    return VAE.load("tiny")


def pixels(b: int = 2, h: int = 32, w: int = 48, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, 3, h, w, generator=g) * 2 - 1


# ---- layout ------------------------------------------------------------------------------

def test_patchify_channel_order_matches_spec_formula():
    z = torch.randn(2, 32, 4, 6)
    p = patchify(z)
    assert p.shape == (2, 128, 2, 3)
    for b in range(2):
        for c in range(32):
            for i in range(2):
                for j in range(2):
                    for y in range(2):
                        for x in range(3):
                            assert p[b, 4 * c + 2 * i + j, y, x] == z[b, c, 2 * y + i, 2 * x + j]


def test_unpatchify_is_the_exact_inverse():
    z = torch.randn(3, 32, 6, 10)
    assert torch.equal(unpatchify(patchify(z)), z)
    p = torch.randn(3, 128, 3, 5)
    assert torch.equal(patchify(unpatchify(p)), p)
    with pytest.raises(VAEError, match="even"):
        patchify(torch.randn(1, 32, 5, 6))


def test_tokens_are_row_major_and_invertible():
    lat = torch.randn(2, 128, 3, 5)
    tokens = to_tokens(lat)
    assert [t.shape for t in tokens] == [(15, 128), (15, 128)]
    for b in range(2):
        for y in range(3):
            for x in range(5):
                assert torch.equal(tokens[b][y * 5 + x], lat[b, :, y, x])
        # each sample owns its storage (saving one never writes the batch)
        assert tokens[b].untyped_storage().nbytes() == 15 * 128 * 4
    assert torch.equal(from_tokens(tokens, (3, 5)), lat)
    assert torch.equal(from_tokens(torch.stack(tokens), (3, 5)), lat)
    assert torch.equal(from_tokens(tokens[1], (3, 5)), lat[1:])
    with pytest.raises(VAEError, match="3x4"):
        from_tokens(tokens, (3, 4))


def test_batch_groups_consecutive_same_size_capped():
    sizes = [(32, 48)] * 3 + [(48, 32), (32, 48)]
    assert batch_groups(sizes, 10**9, 2) == [[0, 1], [2], [3], [4]]
    assert batch_groups(sizes, 10**9, 8) == [[0, 1, 2], [3], [4]]
    assert batch_groups(sizes, 2 * 32 * 48, 8) == [[0, 1], [2], [3], [4]]
    assert batch_groups(sizes, 10, 8) == [[0], [1], [2], [3], [4]]  # at least one image
    assert batch_groups([], 10, 8) == []


# ---- encode / decode ---------------------------------------------------------------------

def test_encode_normalises_with_running_stats(vae):
    x = pixels()
    mean, var = vae.model.bn.running_mean, vae.model.bn.running_var
    assert mean.abs().max() > 0.3 and (var - 1).abs().max() > 0.3  # non-trivial statistics
    with torch.no_grad():
        z = vae.model.encode(x).latent_dist.mode()
    p = patchify(z)
    expected = (p - mean[:, None, None]) / torch.sqrt(var[:, None, None] + vae.config.batch_norm_eps)
    out = vae.encode(x)
    assert out.dtype == torch.float32 and out.shape == (2, 128, 2, 3)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(out, p, atol=1e-2)  # the normalisation did something
    assert vae.config.batch_norm_eps == 1e-4


def test_normalise_denormalise_roundtrip(vae):
    p = torch.randn(2, 128, 2, 3) * 3
    torch.testing.assert_close(vae.denormalise(vae.normalise(p)), p, rtol=0, atol=1e-6)
    lat = torch.randn(2, 128, 2, 3)
    torch.testing.assert_close(vae.normalise(vae.denormalise(lat)), lat, rtol=0, atol=1e-6)


def test_decode_is_the_inverse_path(vae):
    lat = vae.encode(pixels())
    out = vae.decode(lat)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 32, 48)
    assert out.min() >= -1 and out.max() <= 1
    with torch.no_grad():
        z = unpatchify(vae.denormalise(lat))
        expected = vae.model.decode(z).sample.clamp(-1, 1)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert vae.encode(out).shape == lat.shape  # decode then re-encode: same latent grid
    with pytest.raises(VAEError, match="128"):
        vae.decode(torch.zeros(1, 32, 2, 3))


def test_sample_draw_differs_from_mode_and_is_reproducible(vae):
    x = pixels()
    mode = vae.encode(x)
    a = vae.encode(x, draw="sample", generator=torch.Generator().manual_seed(1))
    b = vae.encode(x, draw="sample", generator=torch.Generator().manual_seed(1))
    c = vae.encode(x, draw="sample", generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b)
    assert not torch.allclose(a, mode, atol=1e-3) and not torch.allclose(a, c, atol=1e-3)
    with pytest.raises(VAEError, match="draw"):
        vae.encode(x, draw="mean")


def test_batched_encoding_equals_single(vae):
    imgs = [pixels(1, 32, 48, seed=i)[0] for i in range(3)] + [pixels(1, 48, 32, seed=3)[0],
                                                               pixels(1, 32, 48, seed=4)[0]]
    tokens = vae.encode_batches(imgs, batch=2)
    assert [t.shape for t in tokens] == [(6, 128)] * 3 + [(6, 128), (6, 128)]
    for img, tok in zip(imgs, tokens):
        single = to_tokens(vae.encode(img[None]))[0]
        torch.testing.assert_close(tok, single, rtol=0, atol=2e-6)
    grid = from_tokens(tokens[3], (3, 2))
    torch.testing.assert_close(grid, vae.encode(imgs[3][None]), rtol=0, atol=2e-6)


def test_sizes_must_be_multiples_of_16(vae):
    with pytest.raises(VAEError, match="40x48.*multiple of 16"):
        vae.encode(pixels(1, 40, 48))
    with pytest.raises(VAEError, match="multiple of 16"):
        vae.encode_batches([pixels(1, 32, 24)[0]])
    with pytest.raises(VAEError, match=r"\[B, 3, H, W\]"):
        vae.encode(pixels(1)[0])


# ---- identity, dtype, frozen -------------------------------------------------------------

def test_key_id_and_dtypes(vae):
    assert vae.key_id == "flux2-vae-tiny/fp32"
    assert vae.dtype == torch.float32  # auto on CPU
    half = VAE.load("tiny", dtype="bf16")
    assert half.key_id == "flux2-vae-tiny/bf16"
    assert next(half.model.parameters()).dtype == torch.bfloat16
    # statistics were read in fp32 before the cast
    assert half.mean.dtype == torch.float32 and torch.equal(half.mean, vae.mean)
    assert torch.equal(half.std, vae.std)
    out = half.encode(pixels())
    assert out.dtype == torch.float32
    assert VAE.load("tiny", dtype="fp16").key_id == "flux2-vae-tiny/fp16"
    # the identity is known without loading (cache keys are computed before any encode)
    assert VAE.identity("tiny") == vae.key_id and VAE.identity("tiny", "bf16") == half.key_id
    assert VAE.identity("/nowhere/vae", "fp16", "cpu") == "flux2-vae/fp16"
    with pytest.raises(ValueError, match="auto or one of fp32, bf16, fp16"):
        VAE.load("tiny", dtype="fp8")


def test_frozen_and_deterministic(vae):
    assert not vae.model.training
    assert not any(p.requires_grad for p in vae.model.parameters())
    state = torch.get_rng_state()
    a, b = build_tiny().state_dict(), build_tiny().state_dict()
    assert torch.equal(torch.get_rng_state(), state)  # building does not touch the global RNG
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---- loading layouts ---------------------------------------------------------------------

def save_folder(root: Path) -> Path:
    build_tiny().save_pretrained(root / "vae")
    return root


def assert_same(loaded: VAE, ref: VAE) -> None:
    x = pixels()
    assert torch.equal(loaded.mean, ref.mean) and torch.equal(loaded.std, ref.std)
    torch.testing.assert_close(loaded.encode(x), ref.encode(x), rtol=0, atol=0)
    lat = ref.encode(x)
    torch.testing.assert_close(loaded.decode(lat), ref.decode(lat), rtol=0, atol=0)


def test_diffusers_folder_via_root_and_vae_dir(tmp_path, vae):
    root = save_folder(tmp_path)
    by_root, by_dir = VAE.load(str(root)), VAE.load(str(root / "vae"))
    assert by_root.key_id == by_dir.key_id == "flux2-vae/fp32"
    assert_same(by_root, vae)
    assert_same(by_dir, vae)


def test_single_file_diffusers_naming_with_prefix(tmp_path, vae):
    sd = build_tiny().state_dict()
    folder = tmp_path / "vae"
    folder.mkdir()
    save_file({f"vae.{k}": v.contiguous() for k, v in sd.items()}, folder / "tiny.safetensors")
    (folder / "config.json").write_text(json.dumps(dict(build_tiny().config)))
    loaded = VAE.load(str(folder / "tiny.safetensors"))
    assert loaded.key_id == "flux2-vae/fp32"
    assert_same(loaded, vae)
    # without a config.json beside it the published defaults apply, and shapes disagree
    (folder / "config.json").unlink()
    with pytest.raises(VAEError, match=r"not a FLUX.2 VAE matching .*config\.json.*68 missing"):
        VAE.load(str(folder / "tiny.safetensors"))
    # same key set, other widths: the shape check names the tensor
    (folder / "config.json").write_text(json.dumps({**build_tiny().config, "latent_channels": 16}))
    with pytest.raises(VAEError, match=r"shapes do not match the config.json beside it: encoder"
                                       r".conv_out.weight \[64, 32, 3, 3\] \(expected \[32, 32, 3, 3\]"):
        VAE.load(str(folder / "tiny.safetensors"))


def to_bfl(sd: dict[str, torch.Tensor], nested_quant: bool) -> dict[str, torch.Tensor]:
    """diffusers -> Black Forest Labs / LDM VAE naming (an independent reference mapping)."""
    n = 4
    rules = [
        (r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.", lambda m: f"encoder.down.{m[1]}.block.{m[2]}."),
        (r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", lambda m: f"encoder.down.{m[1]}.downsample."),
        (r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.", lambda m: f"decoder.up.{n - 1 - int(m[1])}.block.{m[2]}."),
        (r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.", lambda m: f"decoder.up.{n - 1 - int(m[1])}.upsample."),
        (r"(encoder|decoder)\.mid_block\.resnets\.(\d)\.", lambda m: f"{m[1]}.mid.block_{int(m[2]) + 1}."),
        (r"(encoder|decoder)\.mid_block\.attentions\.0\.", lambda m: f"{m[1]}.mid.attn_1."),
        (r"conv_norm_out\.", lambda m: "norm_out."),
        (r"conv_shortcut\.", lambda m: "nin_shortcut."),
        (r"attn_1\.group_norm\.", lambda m: "attn_1.norm."),
        (r"attn_1\.to_([qkv])\.", lambda m: f"attn_1.{m[1]}."),
        (r"attn_1\.to_out\.0\.", lambda m: "attn_1.proj_out."),
    ]
    if nested_quant:
        rules += [(r"^quant_conv\.", lambda m: "encoder.quant_conv."),
                  (r"^post_quant_conv\.", lambda m: "decoder.post_quant_conv.")]
    out = {}
    for k, v in sd.items():
        for pattern, repl in rules:
            k = re.sub(pattern, repl, k)
        if ".attn_1." in k and k.endswith("weight") and v.ndim == 2:
            v = v[:, :, None, None]  # 1x1 convs in the original
        out[k] = v.contiguous()
    return out


@pytest.mark.parametrize("nested_quant,prefix", [(True, ""), (False, "first_stage_model.")])
def test_single_file_bfl_ldm_naming(tmp_path, vae, nested_quant, prefix):
    bfl = to_bfl(build_tiny().state_dict(), nested_quant)
    for key in ("encoder.down.1.block.0.nin_shortcut.weight", "decoder.up.0.block.0.nin_shortcut.weight",
                "decoder.up.3.upsample.conv.weight", "encoder.mid.block_2.conv1.weight",
                "bn.running_mean", "bn.running_var"):
        assert key in bfl
    assert bfl["encoder.mid.attn_1.q.weight"].ndim == 4
    assert ("encoder.quant_conv.weight" in bfl) == nested_quant
    assert ("post_quant_conv.weight" in bfl) != nested_quant
    file = tmp_path / "vae" / "flux2-vae.safetensors"
    file.parent.mkdir()
    save_file({prefix + k: v for k, v in bfl.items()}, file)
    (file.parent / "config.json").write_text(json.dumps(dict(build_tiny().config)))
    assert_same(VAE.load(str(file)), vae)

    bfl["encoder.extra.weight"] = torch.zeros(2)
    save_file({prefix + k: v for k, v in bfl.items()}, file)
    with pytest.raises(VAEError, match="not recognised.*encoder.extra.weight"):
        VAE.load(str(file))


def test_single_file_comfy_fp8_is_dequantized(tmp_path, vae):
    sd = {k: v.contiguous() for k, v in build_tiny().state_dict().items()}
    name = "decoder.conv_in.weight"
    codes, scale, fmt = quantize_fp8(sd[name])
    sd[name] = codes
    sd[name.replace(".weight", ".weight_scale")] = scale
    sd[name.replace(".weight", ".comfy_quant")] = encode_format(fmt)
    save_file(sd, tmp_path / "q.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(dict(build_tiny().config)))
    loaded = VAE.load(str(tmp_path / "q.safetensors"))
    w = loaded.model.decoder.conv_in.weight
    torch.testing.assert_close(w, codes.float() * scale, rtol=0, atol=0)
    torch.testing.assert_close(w, vae.model.decoder.conv_in.weight, rtol=0.07, atol=1e-3)
    torch.testing.assert_close(loaded.encode(pixels()), vae.encode(pixels()), rtol=0, atol=0)


def test_bad_paths_are_clear(tmp_path):
    with pytest.raises(VAEError, match="does not exist.*tiny"):
        VAE.load(str(tmp_path / "missing"))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(VAEError, match="not a .safetensors file"):
        VAE.load(str(tmp_path / "notes.txt"))
    with pytest.raises(VAEError, match="no config.json"):
        VAE.load(str(tmp_path))
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    with pytest.raises(VAEError, match="AutoencoderKL, not AutoencoderKLFlux2"):
        VAE.load(str(tmp_path))
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(VAEError, match="not a readable safetensors"):
        VAE.load(str(tmp_path / "junk.safetensors"))
