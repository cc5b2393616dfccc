"""Euler + CFG sampling: guidance algebra, skipped block, packing, seeds."""

from __future__ import annotations

import logging

import pytest
import torch

from kohakumoss.diffusion.sampler import Request, initial_noise, sample, skipping, velocity
from kohakumoss.diffusion.schedule import inference_sigmas
from kohakumoss.model.engines import Handle
from kohakumoss.model import build_layout, cast_model
from kohakumoss.model.build import tiny_transformer
from kohakumoss.checks.parity import rel_error


def _setup():
    model = cast_model(tiny_transformer(), torch.float64).eval()
    g = torch.Generator().manual_seed(3)
    reqs = [Request(torch.randn(5 + i, 48, generator=g, dtype=torch.float64),
                    torch.randn(3, 48, generator=g, dtype=torch.float64), hw, seed=10 + i)
            for i, hw in enumerate([(3, 4), (2, 2), (4, 3)])]
    return model, reqs


def _forward(model, x, text, hw, sigma, skip=()):
    lay = build_layout([hw], [len(text)])
    with torch.no_grad():
        return model(x.double(), text, torch.tensor([sigma]), lay, replace=skipping(skip)).float()


def test_cfg_one_is_the_plain_conditional_forward():
    model, reqs = _setup()
    x = [initial_noise(r.seed, r.hw) for r in reqs]
    v = velocity(model, x, reqs, 0.7, 1.0, (1,), "cpu", torch.float64)
    for xi, r, vi in zip(x, reqs, v):
        assert torch.equal(vi, _forward(model, xi, r.text, r.hw, 0.7))


def test_packed_guidance_equals_two_forwards_with_the_block_skipped():
    model, reqs = _setup()
    x = [initial_noise(r.seed, r.hw) for r in reqs]
    v = velocity(model, x, reqs, 0.4, 3.0, (1,), "cpu", torch.float64)
    for xi, r, vi in zip(x, reqs, v):
        pos = _forward(model, xi, r.text, r.hw, 0.4)
        neg = _forward(model, xi, r.negative, r.hw, 0.4, skip=(1,))
        assert rel_error(vi, neg + 3.0 * (pos - neg)) < 1e-6
        # the skipped-block negative is the forward with that block removed
        removed = torch.nn.ModuleList([model.layers[0], model.layers[2]])
        full, model.layers = model.layers, removed
        try:
            assert torch.equal(neg, _forward(model, xi, r.negative, r.hw, 0.4))
        finally:
            model.layers = full


def test_same_seed_same_image_whatever_the_batch():
    model, reqs = _setup()
    alone = sample(model, [reqs[1]], steps=4, cfg=2.5, skip_layers=(1,), dtype=torch.float64)[0]
    batched = sample(model, reqs, steps=4, cfg=2.5, skip_layers=(1,), dtype=torch.float64)[1]
    assert rel_error(batched, alone) < 1e-12
    other = sample(model, [Request(reqs[1].text, reqs[1].negative, reqs[1].hw, 99)], steps=4,
                   cfg=2.5, skip_layers=(1,), dtype=torch.float64)[0]
    assert rel_error(other, alone) > 1e-2


def test_the_text_refiner_runs_once_a_run_and_the_image_is_the_same():
    """The refiner does not see the timestep: a sampling run refines its prompts on the first
    step and keeps them (``Packed.text_cache``); the images are those of a loop that refines
    them every step. Where an engine hooks the refiner's blocks (weight streaming; one
    registered in the model's ``engines``) it runs every step."""
    model, reqs = _setup()
    calls = []
    refine = model.refine_text
    model.refine_text = lambda *a: calls.append(1) or refine(*a)
    images = sample(model, reqs, steps=4, cfg=2.5, skip_layers=(1,), dtype=torch.float64)
    assert len(calls) == 1
    sigmas = inference_sigmas(4, 5.0).tolist()
    x = [initial_noise(r.seed, r.hw) for r in reqs]
    for i in range(4):  # velocity() packs afresh each call: the refiner runs every step
        v = velocity(model, x, reqs, sigmas[i], 2.5, (1,), "cpu", torch.float64)
        x = [xi + (sigmas[i + 1] - sigmas[i]) * vi for xi, vi in zip(x, v)]
    assert len(calls) == 5
    assert all(torch.equal(a, b) for a, b in zip(images, x))
    block = model.text_embedder.blocks[0]
    hooked = Handle("a hook on the refiner", blocks=(block,), text=True)
    hook = block.register_forward_pre_hook(lambda m, a: None)
    try:
        with model.engines.holding(hooked):
            calls.clear()
            again = sample(model, reqs, steps=4, cfg=2.5, skip_layers=(1,), dtype=torch.float64)
        assert len(calls) == 4 and all(torch.equal(a, b) for a, b in zip(images, again))
    finally:
        hook.remove()


def test_noise_layout_and_skip_validation():
    n = initial_noise(5, (2, 3))
    ref = torch.randn(1, 128, 2, 3, generator=torch.Generator().manual_seed(5))
    assert torch.equal(n[4], ref[0, :, 1, 1])  # token y*w + x
    model, reqs = _setup()
    try:
        sample(model, reqs[:1], steps=2, skip_layers=(7,))
    except ValueError as e:
        assert "outside [0, 3)" in str(e)
    else:
        raise AssertionError("an out-of-range skip layer must be refused")


def test_kmoss_sample_writes_pngs_with_settings(tmp_path):
    import json

    from PIL import Image
    from typer.testing import CliRunner

    from stages.cli import app

    from conftest import ROOT

    res = CliRunner().invoke(app, ["sample", "-P", "a red circle", "-P", "blue stripes", "--size",
                                   "48x32", "--steps", "3", "--count", "2", "--seed", "5",
                                   "--dtype", "fp32", "--params", str(ROOT / "params.yaml"),
                                   "--out", str(tmp_path / "s")])
    assert res.exit_code == 0, res.output
    files = sorted((tmp_path / "s").glob("*-seed*.png"))
    assert [f.name for f in files] == ["0000-seed5.png", "0001-seed6.png", "0002-seed7.png",
                                       "0003-seed8.png"]
    meta = json.loads(Image.open(files[2]).text["kohakumoss"])
    assert meta["prompt"] == "blue stripes" and meta["seed"] == 7 and meta["steps"] == 3
    assert Image.open(files[0]).size == (48, 32)
    from kohakumoss.images import MIN_CELL

    assert Image.open(tmp_path / "s" / "contact_sheet.png").size[0] == 2 * max(48, MIN_CELL)


def test_contact_sheet_labels_are_whole_not_cut_to_a_word():
    """A 64-pixel preview's label was cut to its first word: now it wraps over lines in a
    cell at least MIN_CELL wide, and a label too long for four lines ends in "..."."""
    from PIL import Image

    from kohakumoss.images import CHAR, MAX_LINES, MIN_CELL, contact_sheet, label_lines

    prompt = "0: kohaku, 2 red circles, blue background"
    lines = label_lines(prompt, MIN_CELL)
    assert " ".join(lines) == prompt and all(len(ln) * CHAR <= MIN_CELL for ln in lines)
    long = label_lines("word " * 200, MIN_CELL)
    assert len(long) == MAX_LINES and long[-1].endswith("...")
    images = [Image.new("RGB", (64, 64), c) for c in ("red", "blue")]
    sheet = contact_sheet(images, [prompt, "1: green"], columns=2)
    assert sheet.size[0] == 2 * MIN_CELL and sheet.size[1] > 64 + 12 * len(lines)
    # the label's pixels: dark text in the band above each image
    band = sheet.crop((0, 0, MIN_CELL, 12 * len(lines)))
    rows_with_ink = {y for y in range(band.size[1]) for x in range(band.size[0])
                     if band.getpixel((x, y))[0] < 128}
    assert max(rows_with_ink) > 12 * (len(lines) - 1)  # the last line is drawn too


def test_grid_strength_zero_is_the_base_and_adapters_come_off(tmp_path):
    import numpy as np
    import torch

    from kohakumoss.adapters import apply_adapters
    from kohakumoss.config import AdapterConfig
    from kohakumoss.params import load_params
    from kohakumoss.generate import Generator, Settings, grid
    from kohakumoss.formats.checkpoint import save_checkpoint

    from conftest import ROOT

    p = load_params(ROOT / "params.yaml")
    gen = Generator(p, torch.device("cpu"), torch.float32)
    s = Settings(32, 32, 2, 3.0, 5.0)
    base = gen.images(["a red circle"], [0], s)[0]
    # a checkpoint of a LoRA with non-zero weights
    cfg = AdapterConfig(dim=4, alpha=4)
    from kohakumoss.model.build import tiny_transformer

    ad = apply_adapters(tiny_transformer(), cfg, seed=0)
    state = {k: (v + 0.05 if "up" in k else v) for k, v in ad.state_dict().items()}
    ck = save_checkpoint(tmp_path, 1, state, {}, {"trained": {
        "algo": "lora", "preset": "attn-mlp", "targets": [], "dim": 4, "alpha": 4.0, "dora": False,
        "algo_kwargs": {}, "train_norms": False}, "steps": 1})
    img = grid(gen, ["a red circle"], [[], [f"{ck}:1.0"]], ["base", "lora"], 0, s)
    from kohakumoss.images import MIN_CELL

    band = img.size[1] - 32  # the labels above the images
    x0 = (MIN_CELL - 32) // 2  # each image centred in its cell
    assert img.size[0] == 2 * MIN_CELL and band > 0
    left = np.asarray(img)[band:, x0:x0 + 32]
    assert np.array_equal(left, np.asarray(base))  # strength 0 / no adapter = the base
    right = np.asarray(img)[band:, MIN_CELL + x0:MIN_CELL + x0 + 32]
    assert not np.array_equal(right, left)  # the adapter changes the image
    assert np.array_equal(np.asarray(gen.images(["a red circle"], [0], s)[0]), np.asarray(base))


@pytest.mark.gpu
def test_a_cuda_graph_replays_the_eager_forward_exactly(caplog):
    """Sampling with the forward captured once and replayed gives the eager sampler's
    latents bit for bit (the same kernels on the same inputs)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = cast_model(tiny_transformer(), torch.bfloat16).cuda().eval()
    g = torch.Generator().manual_seed(3)
    reqs = [Request(torch.randn(5 + i, 48, generator=g), torch.randn(3, 48, generator=g), hw, 10 + i)
            for i, hw in enumerate([(3, 4), (2, 2)])]
    eager = sample(model, reqs, steps=6, cfg=2.5, skip_layers=(1,), device="cuda", dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, "kohakumoss.diffusion"):
        graphed = sample(model, reqs, steps=6, cfg=2.5, skip_layers=(1,), device="cuda",
                         dtype=torch.bfloat16, cuda_graph=True)
    assert "without a CUDA graph" not in caplog.text  # it was captured, not fallen back from
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)
