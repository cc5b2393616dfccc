"""Bad command-line inputs give one `error:` line naming the file or option and exit status 2,
never a traceback: files that are not adapters (export checkpoint, check export), a bad
--size / --adapter / --dtype / --strengths (sample, grid), a vector set that is not one
(check parity)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from typer.testing import CliRunner

from kohakumoss.model.build import tiny_transformer
from stages.cli import app

from conftest import ROOT

runner = CliRunner()
PARAMS = str(ROOT / "params.yaml")  # the tiny model
VECTORS = ROOT / "tests" / "data" / "vectors"
GOOD_ADAPTER = VECTORS / "lora_lycoris.safetensors"


def _fails(args: list[str], *needles: str) -> str:
    """Run `kmoss ARGS`: exit 2, exactly one `error:` line holding every needle, no traceback."""
    res = runner.invoke(app, args)
    out = res.output
    assert res.exit_code == 2, out
    assert "Traceback" not in out and isinstance(res.exception, SystemExit), out
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, out
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def _bad_file(tmp: Path, kind: str) -> Path:
    """A file (or folder) that is not an adapter file, of the given kind."""
    path = tmp / f"{kind}.safetensors"
    if kind == "text":
        path.write_text("not a tensor in sight\n")
    elif kind == "png":
        path = tmp / "image.png"
        Image.new("RGB", (8, 8), "red").save(path)
    elif kind == "png_named_safetensors":
        Image.new("RGB", (8, 8), "red").save(path, format="PNG")
    elif kind == "truncated":
        data = GOOD_ADAPTER.read_bytes()
        path.write_bytes(data[:len(data) // 2])
    elif kind == "zero_bytes":
        path.write_bytes(b"")
    elif kind == "folder":
        path = tmp / "not-a-checkpoint"
        path.mkdir()
        (path / "notes.txt").write_text("x")
    elif kind == "missing":
        path = tmp / "no-such-file.safetensors"
    elif kind == "no_tensors":
        save_file({}, str(path))
    elif kind == "foreign_keys":
        save_file({"model.embed.weight": torch.zeros(2, 2), "cond.bias": torch.zeros(2)}, str(path))
    elif kind == "model_weights":
        save_file({k: v.contiguous() for k, v in tiny_transformer().state_dict().items()}, str(path))
    return path


NOT_A_FILE = {"text": "is not a safetensors file", "png": "is not a safetensors file",
              "png_named_safetensors": "is not a safetensors file",
              "truncated": "is not a safetensors file", "zero_bytes": "an empty file",
              "missing": "does not exist"}
NO_ADAPTER = {"no_tensors": "no adapter weights of a known layout (LyCORIS / ComfyUI)",
              "foreign_keys": "no adapter weights of a known layout (LyCORIS / ComfyUI)",
              "model_weights": "no adapter weights of a known layout (LyCORIS / ComfyUI)"}


@pytest.mark.parametrize("kind, says", [*NOT_A_FILE.items(), *NO_ADAPTER.items(),
                                        ("folder", "not a training checkpoint")])
def test_export_checkpoint_refuses_what_is_not_a_source(tmp_path, kind, says):
    bad = _bad_file(tmp_path, kind)
    out = tmp_path / "out.safetensors"
    _fails(["export", "checkpoint", str(bad), "--out", str(out), "--params", PARAMS], str(bad), says)
    assert not out.exists() and not list(tmp_path.glob("*-comfy*"))  # nothing written


@pytest.mark.parametrize("kind, says", [*NOT_A_FILE.items(), *NO_ADAPTER.items(),
                                        ("folder", "is a folder")])
def test_check_export_refuses_a_file_that_is_not_an_adapter(tmp_path, kind, says):
    bad = _bad_file(tmp_path, kind)
    _fails(["check", "export", str(bad), "--source", str(GOOD_ADAPTER), "--params", PARAMS],
           str(bad), says)


@pytest.mark.parametrize("kind", ["truncated", "no_tensors", "folder", "missing"])
def test_check_export_refuses_a_bad_source(tmp_path, kind):
    bad = _bad_file(tmp_path, kind)
    _fails(["check", "export", str(GOOD_ADAPTER), "--source", str(bad), "--params", PARAMS],
           str(bad))


@pytest.mark.parametrize("option, value, says", [
    ("--format", "onnx", "one of comfy, lycoris, merged, diffusers"),
    ("--dtype", "fp8", "one of bf16, fp16, fp32"),
    ("--style", "kohya", "one of lora_unet, diffusion_model"),
])
def test_export_checkpoint_refuses_bad_options(tmp_path, option, value, says):
    out = tmp_path / "out.safetensors"
    _fails(["export", "checkpoint", str(GOOD_ADAPTER), option, value, "--out", str(out),
            "--params", PARAMS], repr(value), says)
    assert not out.exists()


def test_export_checkpoint_without_a_base_model(tmp_path):
    """No --model and no params file: the line names both ways to give the base; a --model
    that is not a model names the path."""
    out = tmp_path / "out.safetensors"
    _fails(["export", "checkpoint", str(GOOD_ADAPTER), "--out", str(out), "--params",
            str(tmp_path / "none.yaml")], str(GOOD_ADAPTER), "--model", "model.transformer")
    _fails(["export", "checkpoint", str(GOOD_ADAPTER), "--out", str(out), "--model",
            str(tmp_path / "no-model")], "no-model does not exist")
    assert not out.exists()


SIZE_FORM = "WIDTHxHEIGHT with both sides positive multiples of 16"


@pytest.mark.parametrize("command", ["sample", "grid"])
@pytest.mark.parametrize("size", ["64", "axb", "0x64", "65x64", "64x", "-16x64", "64x64x64"])
def test_sample_and_grid_refuse_a_bad_size(tmp_path, command, size):
    _fails([command, "-P", "a cat", "--size", size, "--params", PARAMS, "--out",
            str(tmp_path / "o")], "--size", repr(size), SIZE_FORM)


@pytest.mark.parametrize("command", ["sample", "grid"])
@pytest.mark.parametrize("kind, says", [("missing", "does not exist"),
                                        ("folder", "not a training checkpoint")])
def test_sample_and_grid_refuse_a_missing_adapter(tmp_path, command, kind, says):
    bad = _bad_file(tmp_path, kind)
    _fails([command, "-P", "a cat", "--size", "32x32", "--adapter", f"{bad}:0.5", "--params", PARAMS,
            "--out", str(tmp_path / "o")], "--adapter", f"{bad}:0.5", says, "PATH[:STRENGTH]")


@pytest.mark.parametrize("command", ["sample", "grid"])
@pytest.mark.parametrize("kind", ["text", "zero_bytes", "no_tensors"])
def test_sample_and_grid_refuse_an_adapter_file_that_is_not_one(tmp_path, command, kind):
    bad = _bad_file(tmp_path, kind)
    _fails([command, "-P", "a cat", "--size", "32x32", "--steps", "1", "--adapter", str(bad),
            "--params", PARAMS, "--out", str(tmp_path / "o")], str(bad))


@pytest.mark.parametrize("command, args, needles", [
    ("sample", ["--dtype", "fp8"], ["--dtype", "'fp8'", "bf16, fp16, fp32"]),
    ("sample", ["--steps", "0"], ["--steps 0", ">= 1"]),
    ("sample", ["--prompts-file", "no-such-prompts.txt"], ["--prompts-file", "no-such-prompts.txt"]),
    ("grid", ["--dtype", "fp8"], ["--dtype", "'fp8'"]),
    ("grid", ["--strengths", "0,1"], ["--strengths", "exactly one --adapter"]),
    ("grid", ["--strengths", "0,lots", "--adapter", str(GOOD_ADAPTER)],
     ["--strengths", "'0,lots'", "numbers separated by commas"]),
])
def test_sample_and_grid_refuse_other_bad_options(tmp_path, command, args, needles):
    _fails([command, "-P", "a cat", "--size", "32x32", *args, "--params", PARAMS, "--out",
            str(tmp_path / "o")], *needles)


def test_sample_without_a_prompt():
    _fails(["sample", "--size", "32x32", "--params", PARAMS], "--prompt")


def _vector_set(tmp: Path, kind: str) -> Path:
    folder = tmp / kind
    if kind == "missing":
        return folder
    if kind == "a_file":
        folder.write_text("x")
        return folder
    folder.mkdir()
    if kind in ("weights_only", "text_batch"):
        (folder / "weights_official.safetensors").write_bytes(
            (VECTORS / "weights_official.safetensors").read_bytes())
    if kind == "batch_only":
        (folder / "batch.safetensors").write_bytes((VECTORS / "batch.safetensors").read_bytes())
    if kind == "text_batch":
        (folder / "batch.safetensors").write_text("not tensors")
    return folder


@pytest.mark.parametrize("kind, says", [
    ("missing", "does not exist"), ("a_file", "is not a folder"),
    ("empty", "lacks batch.safetensors and weights_official.safetensors"),
    ("weights_only", "lacks batch.safetensors"), ("batch_only", "lacks weights_official"),
    ("text_batch", "is not a readable safetensors file"),
])
def test_check_parity_refuses_a_folder_that_is_not_a_vector_set(tmp_path, kind, says):
    folder = _vector_set(tmp_path, kind)
    line = _fails(["check", "parity", str(folder)], str(folder), says)
    assert "reference vector set" in line


def test_check_export_against_a_full_finetune(tmp_path):
    from kohakumoss.formats.checkpoint import save_checkpoint

    weights = {k: v + 0.01 for k, v in tiny_transformer().state_dict().items()}
    full = save_checkpoint(tmp_path / "ck", 3, weights, {}, {"trained": {"algo": "full"}, "steps": 3})
    _fails(["check", "export", str(GOOD_ADAPTER), "--source", str(full), "--params", PARAMS],
           str(full), "full finetune")
