"""`kmoss config`: weights and data detected, card presets, the estimate, no silent overwrite,
and a written params file that `dvc repro` runs (docs/config.md)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from kohakumoss.configlib import ConfigError
from kohakumoss.encoders.text import tiny_config, tiny_state_dict, tiny_tokenizer
from kohakumoss.encoders.vae import build_tiny
from kohakumoss.formats.model_files import save_comfy
from kohakumoss.model import FLAVORS
from kohakumoss.model.build import tiny_transformer
from kohakumoss.params import load_params
from kohakumoss.setup.configure import PRESETS, TEMPLATE, configure
from kohakumoss.setup.detect import find_data, find_weights

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "dataset"


def comfy_models(root: Path, quantized: bool = True) -> Path:
    """A ComfyUI ``models/`` folder holding the tiny components in ComfyUI's real layouts
    (file names that say nothing: they are found by their keys)."""
    models = root / "ComfyUI" / "models"
    for d in ("diffusion_models", "text_encoders", "vae", "loras"):
        (models / d).mkdir(parents=True)
    state = tiny_transformer().state_dict()
    save_comfy(state, models / "diffusion_models" / "a.safetensors", FLAVORS["tiny"], dtype=torch.float32)
    if quantized:
        save_comfy(state, models / "diffusion_models" / "b_fp8.safetensors", FLAVORS["tiny"],
                   dtype=torch.float32, quantize="fp8")
    save_file({f"model.{k}": v for k, v in tiny_state_dict(tiny_config()).items()},
              str(models / "text_encoders" / "te.safetensors"))
    tiny_tokenizer().save_pretrained(models / "text_encoders" / "tokenizer")
    vae = build_tiny()
    save_file({k: v.contiguous() for k, v in vae.state_dict().items()}, str(models / "vae" / "ae.safetensors"))
    (models / "vae" / "config.json").write_text(json.dumps(dict(vae.config)))
    save_file({"x": torch.zeros(2)}, str(models / "loras" / "unrelated.safetensors"))
    return models


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return comfy_models(tmp_path_factory.mktemp("comfy"))


def test_weights_are_found_by_their_keys_in_a_comfy_models_folder(models):
    for where in (models, models.parent):  # models/ itself or ComfyUI's root
        found = find_weights(str(where))
        assert found.layout == "comfy"
        assert Path(found.transformer).name == "a.safetensors"  # unquantized first
        assert Path(found.text_encoder).name == "te.safetensors" and Path(found.vae).name == "ae.safetensors"
        assert any("b_fp8.safetensors (fp8)" in n for n in found.notes)
        # the tokenizer beside the text encoder counts caption tokens (not the tiny one)
        assert found.caption_tokenizer == str(models / "text_encoders" / "tokenizer")


def test_a_quantized_transformer_alone_is_taken_and_its_codes_kept_where_they_can_be(tmp_path):
    """An fp8 file alone: a resident profile keeps its codes (precision.base: fp8); a streamed
    one (the 6 GB preset) dequantizes it on load, and says why."""
    models = comfy_models(tmp_path, quantized=True)
    (models / "diffusion_models" / "a.safetensors").unlink()
    found = find_weights(str(models))
    assert Path(found.transformer).name == "b_fp8.safetensors" and found.quantized == "fp8"
    proj = _project(tmp_path)
    report = configure(proj / "params.yaml", weights=str(models), data=str(EXAMPLES), vram="24")
    assert load_params(proj / "params.yaml").precision.base == "fp8"
    assert "precision.base: fp8 keeps its codes as stored" in "\n".join(report.lines)
    report = configure(proj / "params.yaml", weights=str(models), data=str(EXAMPLES), vram="6", force=True)
    assert load_params(proj / "params.yaml").precision.base == "keep"
    assert "dequantized on load (profile minimal streams" in "\n".join(report.lines)


def test_bad_weights_and_data_are_clear_errors(tmp_path, models):
    with pytest.raises(ConfigError, match="--weights .*nope: does not exist; give 'tiny', a MOSS-Image pipeline"):
        find_weights(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="neither a pipeline folder .* nor a ComfyUI models/ folder"):
        find_weights(str(tmp_path / "empty"))
    partial = tmp_path / "partial" / "models"
    shutil.copytree(models, partial)
    (partial / "vae" / "ae.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"has no a FLUX.2 VAE in vae/ \(.safetensors files are read by their keys"):
        find_weights(str(partial))
    (tmp_path / "pipe" / "transformer").mkdir(parents=True)
    with pytest.raises(ConfigError, match="a pipeline folder without text_encoder/, vae/"):
        find_weights(str(tmp_path / "pipe"))
    with pytest.raises(ConfigError, match="--data .*none: does not exist"):
        find_data(str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="no images, shards, parquet or jsonl file found"):
        find_data(str(tmp_path / "empty"))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match="a .txt file"):
        find_data(str(tmp_path / "notes.txt"))


def test_the_data_source_kind_is_detected(tmp_path):
    assert find_data(str(EXAMPLES))[0]["source"] == "kohya"
    flat = tmp_path / "flat"
    shutil.copytree(next(p for p in EXAMPLES.iterdir() if p.is_dir()), flat)
    assert find_data(str(flat))[0] == {"source": "folder", "path": str(flat), "txt_as": "tags"}
    (tmp_path / "tars").mkdir()
    (tmp_path / "tars" / "a-000.tar").write_bytes(b"")
    assert find_data(str(tmp_path / "tars"))[0] == {"source": "webdataset", "path": str(tmp_path / "tars" / "*.tar")}
    assert find_data("shards/x-*.tar")[0]["source"] == "webdataset"
    (tmp_path / "set.parquet").write_bytes(b"")
    assert find_data(str(tmp_path / "set.parquet"))[0]["source"] == "parquet"
    (tmp_path / "conv" / "shards").mkdir(parents=True)
    assert find_data(str(tmp_path / "conv"))[0]["source"] == "moss_shard"


def _project(tmp_path: Path) -> Path:
    proj = tmp_path / "proj"
    proj.mkdir()
    shutil.copytree(ROOT / "recipes", proj / "recipes")
    return proj


@pytest.mark.parametrize("vram", sorted(PRESETS))
def test_each_vram_preset_gives_the_documented_profile_and_budget(tmp_path, models, vram):
    """The table in docs/config.md is what each preset writes, and the file loads as every
    stage loads it; the estimator's word is printed."""
    docs = (ROOT / "docs" / "config.md").read_text()
    preset = PRESETS[vram]
    row = f"| `{vram}` | `{preset.profile}` | {preset.samples} | {preset.max_tokens} | `{preset.text_stream}` |"
    assert row in docs, row
    proj = _project(tmp_path)
    report = configure(proj / "params.yaml", weights=str(models), data=str(EXAMPLES), name="mine", vram=vram)
    p = load_params(proj / "params.yaml")
    assert (p.profile, p.batching.max_tokens, p.resolution.target_area) == (preset.profile, preset.max_tokens, 1048576)
    assert p.encoders.text_stream == preset.text_stream and p.train.dtype == "bf16"
    assert p.adapter.full == preset.full and p.run.name == "mine"
    assert p.model.transformer.endswith("a.safetensors") and p.data.datasets[0].source == "kohya"
    assert p.adapter.dim == (32 if not preset.full else p.adapter.dim)  # the recipe's rank
    text = "\n".join(report.lines)
    assert f"estimate on a {preset.vram_gib} GiB card" in text and "predicted peak" in text
    assert "recipe: " in text and ("full-1mp" if preset.full else "lora-1mp") in text
    # the comments of the template survive the edit
    assert "# memory engines (docs/memory.md)" in (proj / "params.yaml").read_text()


def test_vram_auto_reads_the_card(tmp_path, models):
    proj = _project(tmp_path)
    report = configure(proj / "params.yaml", weights=str(models), vram="auto", card=lambda: 11.6)
    assert load_params(proj / "params.yaml").profile == PRESETS["12"].profile
    assert "vram: auto read 11.6 GiB on cuda:0: preset 12" in report.lines
    report = configure(proj / "p2.yaml", vram="auto", card=lambda: None)
    assert any("found no CUDA device" in line for line in report.lines)
    # a card without bf16 (a T4, 15 GiB) trains in fp16
    report = configure(proj / "p3.yaml", weights=str(models), vram="auto", card=lambda: 14.6,
                       bf16=lambda: False)
    p = load_params(proj / "p3.yaml")
    assert (p.profile, p.train.dtype) == (PRESETS["12"].profile, "fp16")
    assert any("the card has no bf16: fp16 with loss scaling" in line for line in report.lines)


def test_an_existing_file_is_replaced_only_with_force_and_kept(tmp_path):
    proj = _project(tmp_path)
    params = proj / "params.yaml"
    configure(params, data=str(EXAMPLES), name="first")
    before = params.read_text()
    with pytest.raises(ConfigError, match="params.yaml exists: pass --force"):
        configure(params, name="second")
    assert params.read_text() == before and not (proj / "params.yaml.bak").exists()
    report = configure(params, name="second", force=True)
    assert report.backup == proj / "params.yaml.bak" and report.backup.read_text() == before
    assert load_params(params).run.name == "second"
    # an invalid choice is refused before anything is written
    with pytest.raises(ConfigError, match="adapter.algo"):
        configure(params, algo="lorra", force=True)
    assert load_params(params).run.name == "second"
    with pytest.raises(ConfigError, match="--from 'nope': no such recipe file; recipes in .*: full-1mp, full-1mp-8bit, lora-1mp, lora-1mp-prodigy"):
        configure(params, recipe="nope", force=True)


def test_the_template_is_the_repository_params():
    assert TEMPLATE.read_text() == (ROOT / "params.yaml").read_text()


def test_the_command_line(tmp_path, models):
    kmoss = Path(sys.executable).with_name("kmoss")
    proj = _project(tmp_path)
    res = subprocess.run([str(kmoss), "config", "--weights", str(models), "--data", str(EXAMPLES),
                          "--vram", "8"], cwd=proj, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "preset 8 GiB: profile minimal" in res.stdout and "wrote params.yaml" in res.stdout
    res = subprocess.run([str(kmoss), "config", "--vram", "9"], cwd=proj, capture_output=True, text=True)
    assert res.returncode == 2 and "--vram '9': one of auto, 6, 8, 12, 16, 24, 24-full" in res.stderr


@pytest.mark.slow
def test_dvc_repro_runs_what_config_wrote(tmp_path):
    """A fresh copy of the project, `kmoss config` against the tiny components in ComfyUI's
    layouts and the example data for a 6 GB card, then `dvc exp run` (a short one)."""
    from test_pipeline import _dvc, _git

    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.splitlines()
    proj = tmp_path / "proj"
    for f in files:
        if (ROOT / f).is_file():
            (proj / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, proj / f)
    models = comfy_models(tmp_path, quantized=False)
    configure(proj / "params.yaml", weights=str(models), data="examples/dataset", name="mine", vram="6",
              force=True)
    _git(proj, "init", "-q")
    _git(proj, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    _git(proj, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init")
    # the recipe's 3000 steps and 1024 px previews, cut for the CPU; bf16 stays
    _dvc(proj, "exp", "run", "-S", "train.steps=2", "-S", "preview.every=0", "-S", "train.checkpoint_every=2",
         "-S", "kernels.table=off")
    metrics = json.loads((proj / "runs/mine/dvclive/metrics.json").read_text())
    assert metrics["step"] == 2 and metrics["train"]["loss"] > 0
    assert list((proj / "runs/mine/export").glob("mine-*lora-s2-comfy.safetensors"))  # dvc exp names it
    assert yaml.safe_load((proj / "params.yaml").read_text())["profile"] == "minimal"


def test_a_bare_on_or_off_in_params_is_the_choice_it_spells(tmp_path):
    """PyYAML reads a bare ``on`` as true: a knob whose choices are on/off takes it as "on"."""
    text = TEMPLATE.read_text().replace("text_stream: auto ", "text_stream: on   ")
    assert "text_stream: on " in text
    (tmp_path / "params.yaml").write_text(text)
    assert load_params(tmp_path / "params.yaml").encoders.text_stream == "on"


def test_the_demo_pipeline_keeps_its_small_budget(tmp_path):
    """`--weights examples/tiny-moss` is a pipeline folder the command recognises as the demo
    (its model_index.json): no 1 MP recipe, a preset sets only the profile."""
    proj = _project(tmp_path)
    report = configure(proj / "params.yaml", weights=str(ROOT / "examples" / "tiny-moss"),
                       data=str(EXAMPLES), vram="8", force=True)
    p = load_params(proj / "params.yaml")
    assert p.model.transformer == str(ROOT / "examples" / "tiny-moss")
    assert p.resolution.target_area == 36864 and p.profile == "minimal"
    said = "\n".join(report.lines)
    assert "weights: demo at" in said and "keeps its budget and resolution" in said, said


def test_vram_of_two_cards_splits_the_model_over_them(tmp_path, models):
    """``--vram 12,11``: a 12 GB and an 11 GB card in one PC: parallel.mode threaded over
    both, the smaller card's preset budget, profile auto, and the split the estimate makes
    printed (which blocks where, each card's predicted peak)."""
    proj = _project(tmp_path)
    report = configure(proj / "params.yaml", weights=str(models), data=str(EXAMPLES), vram="12,11")
    p = load_params(proj / "params.yaml")
    assert (p.parallel.mode, p.parallel.devices, p.profile) == ("threaded", ("cuda:0", "cuda:1"), "auto")
    assert p.batching.max_tokens == PRESETS["12"].max_tokens
    text = "\n".join(report.lines)
    assert "estimate on 2 cards of 12, 11 GiB" in text and "split over cuda:0, cuda:1" in text
    assert "split: cuda:0: blocks 0-" in text and "; cuda:1: blocks " in text
    with pytest.raises(ConfigError, match=r"--vram '12,x': several cards are their sizes in GiB"):
        configure(proj / "p2.yaml", vram="12,x")


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml")))
def test_every_recipe_writes_a_params_file_that_loads(tmp_path, models, recipe):
    proj = _project(tmp_path)
    configure(proj / "params.yaml", weights=str(models), data=str(EXAMPLES), name="mine",
              recipe=recipe)
    p = load_params(proj / "params.yaml")
    wanted = yaml.safe_load((ROOT / "recipes" / f"{recipe}.yaml").read_text())["optim"]
    assert p.optim.name == wanted["name"] and p.optim.lr == wanted["lr"]
