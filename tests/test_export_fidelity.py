"""Export fidelity (docs/exports.md#export-fidelity, #strength): every algorithm's bf16 ComfyUI
and LyCORIS files stay within the LoRA error level at strengths 1 and 0.5; strength 0 is the
base exactly; strength is one linear rule in kmoss (bypass, merge, files loaded by kmoss,
the merged export); ComfyUI's slider does what the docs say for each representation, in
float32 and in half-precision patching; `kmoss check export` passes on every algorithm's
file and fails on a broken one or an unloaded key."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from kohakumoss.adapters import merged_weight
from kohakumoss.export.cases import ALGOS, CASES, trained_case
from kohakumoss.export.check import trained_deltas
from kohakumoss.export.formats import load_source, write_export
from kohakumoss.formats.comfy import comfy_state_dict, layer_delta, load_adapter_file
from kohakumoss.formats.comfy_semantics import comfy_weight_deltas, load_patches, rel_error, verify
from kohakumoss.formats.keys import fuse_qkv
from kohakumoss.formats.lycoris import lycoris_metadata, lycoris_state_dict
from kohakumoss.formats.merged import merged_state
from kohakumoss.model import build_layout
from kohakumoss.model.build import tiny_transformer
from kohakumoss.formats.checkpoint import save_checkpoint

BF16_TOL = 5e-3  # the bound; LoRA's own bf16 level is ~2.5e-3 here
BF16 = torch.bfloat16


def _trained(algo: str, kw: dict, noise: float = 0.05, biases: bool = True):
    return trained_case(algo, kw, noise=noise, biases=biases)


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _comfy_rows(aset, tensors, base, strength, dtype=torch.float64):
    """ComfyUI's reading of a fused comfy file at ``strength`` against the documented rule."""
    fused = fuse_qkv(base)
    patches, _ = load_patches(tensors, fused)
    blocks = frozenset(n for n, q in patches.items() if q.kind in ("oft", "boft"))
    return verify(tensors, fused, trained_deltas(aset, True, strength, blocks), strength, dtype)


def _kmoss_loaded_error(aset, model, file, strength, tmp_path) -> float:
    """A file (tensors, metadata) loaded by kmoss (``kmoss sample --adapter FILE:s``: merged at
    s) against the trained adapter merged at s; the largest per-weight error of the delta."""
    path = tmp_path / "f.safetensors"
    save_file(file[0], str(path), file[1])
    fresh = tiny_transformer().float().eval()
    fresh.load_state_dict(_state(model))
    base = _state(fresh)
    handle = load_adapter_file(fresh, path, strength, "merge")
    got, worst = _state(fresh), 0.0
    for p, lyco in aset.modules.items():
        want = merged_weight(lyco, strength)[0] - base[f"{p}.weight"]
        worst = max(worst, rel_error(got[f"{p}.weight"] - base[f"{p}.weight"], want))
    for p, n in aset.norms.items():
        want = n.merged_weight(strength) - base[f"{p}.weight"]
        worst = max(worst, rel_error(got[f"{p}.weight"] - base[f"{p}.weight"], want))
    handle.remove()
    assert all(torch.equal(v, base[k]) for k, v in fresh.state_dict().items())
    return worst


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_files_stay_within_the_lora_error_level(case, tmp_path):
    algo, kw = CASES[case]
    model, aset = _trained(algo, kw)
    base = _state(model)
    comfy, meta = comfy_state_dict(aset, model, fused_qkv=True, dtype=BF16)
    lyco = (lycoris_state_dict(aset, BF16), lycoris_metadata(aset.cfg))
    for s in (1.0, 0.5):
        rows, unloaded = _comfy_rows(aset, comfy, base, s)
        assert not unloaded and rows
        worst = max(rows, key=lambda r: r.rel_error)
        assert worst.rel_error <= BF16_TOL, (s, worst)
        assert _kmoss_loaded_error(aset, model, (comfy, meta), s, tmp_path) <= BF16_TOL, s
        assert _kmoss_loaded_error(aset, model, lyco, s, tmp_path) <= BF16_TOL, ("lycoris", s)


@pytest.mark.parametrize("algo", ["tlora", "dora", "boft-rescaled"])
def test_small_changes_keep_their_precision(algo, tmp_path):
    """With a 100x smaller change, rounding a tensor as large as the weight (T-LoRA's two
    terms, DoRA's magnitude, rescale) would cost 100x more; the files stay at the LoRA level."""
    name, kw = CASES[algo]
    model, aset = _trained(name, kw, noise=5e-4)
    comfy, _ = comfy_state_dict(aset, model, fused_qkv=True, dtype=BF16)
    rows, unloaded = _comfy_rows(aset, comfy, _state(model), 1.0)
    assert not unloaded and max(r.rel_error for r in rows) <= BF16_TOL
    lyco = (lycoris_state_dict(aset, BF16), lycoris_metadata(aset.cfg))
    assert _kmoss_loaded_error(aset, model, lyco, 1.0, tmp_path) <= BF16_TOL


@pytest.mark.parametrize("case", list(ALGOS) + ["oft-rescaled", "boft-rescaled", "lora-norms"])
def test_strength_zero_is_the_base_and_strength_is_linear(case):
    algo, kw = CASES[case]
    model, aset = _trained(algo, kw)
    base = _state(model)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(16, 128, generator=g), torch.randn(8, 48, generator=g),
         torch.tensor([0.3, 0.8]), build_layout([(3, 4), (2, 2)], [5, 3]))
    with torch.no_grad():
        aset.remove()
        y_base = model(*x)
        model, aset = _trained(algo, kw)
        assert all(torch.equal(v, base[k]) for k, v in merged_state(model, aset, 0.0).items())
        aset.set_multiplier(0.0)
        assert torch.equal(model(*x), y_base)  # bypass at 0
        aset.set_multiplier(0.5)
        y_half = model(*x)
        half = merged_state(model, aset, 0.5)
        for p, lyco in aset.modules.items():  # W + s dW, b + s db
            dW = layer_delta(lyco)[0]
            assert rel_error(half[f"{p}.weight"] - base[f"{p}.weight"], 0.5 * dW) <= 1e-5, p
        aset.merge(0.5)
        assert rel_error(model(*x), y_half) <= 1e-5  # bypass at 0.5 == merged at 0.5
        aset.unmerge()


@pytest.mark.parametrize("algo", ["oft", "boft"])
def test_comfy_slider_on_rotation_blocks_and_as_diff(algo, tmp_path):
    """Native blocks: ComfyUI gives OFT s² (R - I) W at s, BOFT its stage interpolation scaled
    by s again, and cannot patch them in half precision; ``rotations="diff"`` is linear and
    patches in fp16."""
    name, kw = CASES[algo]
    model, aset = _trained(name, kw, biases=False)
    base = _state(model)
    paths = [p for p, lyco in aset.modules.items() if lyco.org_module[0].bias is None]
    exact, _ = comfy_state_dict(aset, model, dtype=torch.float32)
    as_diff, _ = comfy_state_dict(aset, model, dtype=torch.float32, rotations="diff")
    blocks_got, _ = comfy_weight_deltas(exact, base, 0.5)
    diff_got, _ = comfy_weight_deltas(as_diff, base, 0.5)
    for p in paths:
        dW = layer_delta(aset.modules[p])[0]
        assert rel_error(diff_got[f"{p}.weight"], 0.5 * dW) <= 1e-6
        gap = rel_error(blocks_got[f"{p}.weight"], 0.5 * dW)
        if algo == "oft":
            assert rel_error(blocks_got[f"{p}.weight"], 0.25 * dW) <= 1e-5
        else:
            assert 0.2 < gap < 0.8, (p, gap)  # neither s nor s² of the change
    _, unloaded = verify(exact, base, trained_deltas(aset), 1.0, torch.float16)
    assert any(k.endswith(".oft_blocks") for k in unloaded)  # ComfyUI fails on them in fp16
    rows, unloaded = verify(as_diff, base, trained_deltas(aset), 1.0, torch.float16)
    assert not unloaded and max(r.rel_error for r in rows) <= 8 * 2.0**-11


@pytest.mark.parametrize("case", ["lora", "dora", "dora-input-axis", "loha", "tlora", "ia3"])
def test_fp16_patching_stays_near_fp16_rounding(case):
    """ComfyUI's low-VRAM fp16 patching of the bf16 file, on the patched weight: within 8 unit
    roundoffs of fp16 (DoRA's fp16 epsilon in each norm is the largest part)."""
    algo, kw = CASES[case]
    model, aset = _trained(algo, kw)
    comfy, _ = comfy_state_dict(aset, model, fused_qkv=True, dtype=BF16)
    for s in (1.0, 0.5):
        rows, unloaded = _comfy_rows(aset, comfy, _state(model), s, torch.float16)
        assert not unloaded and max(r.rel_error for r in rows) <= 8 * 2.0**-11, s


# -- kmoss check export ------------------------------------------------------------------------
def _checkpoint(tmp_path, algo: str, kw: dict):
    """A checkpoint of the adapter on the plain tiny model (what --model tiny rebuilds)."""
    model, aset = _trained(algo, {**kw, "preset": "attn-mlp"}, biases=False)
    cfg = aset.cfg
    trained = {"algo": cfg.algo, "preset": cfg.preset, "targets": [], "dim": cfg.dim,
               "alpha": cfg.alpha, "dora": cfg.dora, "algo_kwargs": dict(cfg.algo_kwargs),
               "train_norms": cfg.train_norms}
    return save_checkpoint(tmp_path / algo / "ck", 5, aset.state_dict(), {}, {"trained": trained})


def _check(*args):
    from stages.cli import app

    return CliRunner().invoke(app, ["check", "export", *map(str, args), "--model", "tiny"])


@pytest.mark.parametrize("algo", list(ALGOS))
def test_check_export_passes_on_every_algorithms_bf16_file(algo, tmp_path):
    ck = _checkpoint(tmp_path, algo, ALGOS[algo])
    out = write_export(load_source(None, ck, model="tiny"), "comfy", tmp_path / "c.safetensors")
    for s in ("1", "0.5"):
        res = _check(out, "--source", ck, "--strength", s)
        assert res.exit_code == 0, res.output
        assert "FAIL" not in res.output and ("NOTE" in res.output) == (algo in ("oft", "boft")
                                                                      and s == "0.5")


@pytest.mark.parametrize("case", ["oft-rescaled", "boft-rescaled", "dora"])
def test_merged_export_at_strength_zero_is_the_base_file(case, tmp_path):
    from kohakumoss.formats.merged import read_merged

    algo, kw = CASES[case]
    ck = _checkpoint(tmp_path, algo, kw)
    src = load_source(None, ck, model="tiny")
    got, _ = read_merged(write_export(src, "merged", tmp_path / "m.safetensors", strength=0.0))
    base = _state(tiny_transformer())
    want = {k: v.to(BF16) for k, v in base.items()}
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    half, _ = read_merged(write_export(src, "merged", tmp_path / "h.safetensors", strength=0.5,
                                       dtype="fp32"))
    for p, lyco in src.adapters.modules.items():  # the merged export follows W + s dW
        dW = layer_delta(lyco)[0]
        assert rel_error(half[f"{p}.weight"] - base[f"{p}.weight"], 0.5 * dW) <= 1e-5


@pytest.mark.parametrize("algo", ["lora", "dora", "oft"])
def test_check_export_fails_on_a_broken_or_unloaded_key(algo, tmp_path):
    ck = _checkpoint(tmp_path, algo, ALGOS[algo])
    out = write_export(load_source(None, ck, model="tiny"), "comfy", tmp_path / "c.safetensors")
    tensors = load_file(str(out))
    key = next(k for k in sorted(tensors) if k.endswith(("lora_up.weight", "oft_blocks")))
    broken = {**tensors, key: tensors[key] * 1.05}
    save_file(broken, str(tmp_path / "broken.safetensors"))
    res = _check(tmp_path / "broken.safetensors", "--source", ck)
    assert res.exit_code == 1 and "FAIL" in res.output and "not loaded" not in res.output
    save_file({**tensors, "lora_unet_layers_0_proj_zzz.lora_up.weight": torch.zeros(2, 2)},
              str(tmp_path / "extra.safetensors"))
    res = _check(tmp_path / "extra.safetensors", "--source", ck)
    assert res.exit_code == 1 and "not loaded by ComfyUI: lora_unet_layers_0_proj_zzz" in res.output
    res = _check(out, "--source", ck, "--patch-dtype", "fp16")
    assert res.exit_code == (1 if algo == "oft" else 0), res.output
    if algo == "oft":  # ComfyUI's OFT cannot patch in fp16: those keys do not apply
        assert "not loaded by ComfyUI" in res.output and "fails when patching" in res.output


@pytest.mark.parametrize("algo", ["ia3", "tlora"])
def test_lycoris_export_of_ia3_and_tlora_says_comfy_skips_it(algo, tmp_path, caplog):
    ck = _checkpoint(tmp_path, algo, ALGOS[algo])
    src = load_source(None, ck, model="tiny")
    with caplog.at_level(logging.WARNING, logger="kohakumoss.export.formats"):
        out = write_export(src, "lycoris", tmp_path / "l.safetensors")
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "ComfyUI does not load" in said and "comfy" in said and str(out) in said
    tensors = load_file(str(out))
    _, unloaded = comfy_weight_deltas(tensors, _state(src.model))  # even on the split layout
    assert unloaded and f"{len(unloaded)} keys" in said  # the count it names is ComfyUI's
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kohakumoss.export.formats"):
        write_export(src, "comfy", tmp_path / "c.safetensors")
    assert not caplog.records
