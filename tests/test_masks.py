"""Loss masks: from a kohya ``img.mask.png`` or the image's alpha channel, cached with the
latents, following the crop, size and flip, weighting the flow loss per token; and the
loss weightings by noise level."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from kohakumoss.configlib import ConfigError
from kohakumoss.data.masks import mask_tokens
from kohakumoss.diffusion.objective import flow_loss, sigma_weight
from kohakumoss.params import load_params
from kohakumoss.training.trainer import Trainer

from conftest import make_kohya
from test_train import _prepare, _write_params


def _png(image: Image.Image) -> bytes:
    import io

    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def test_a_mask_follows_the_crop_the_size_and_the_flip():
    rgba = np.zeros((64, 96, 4), np.uint8)
    rgba[..., 3] = 255
    rgba[:, :48, 3] = 0  # the left half transparent
    image = _png(Image.fromarray(rgba, "RGBA"))
    whole = mask_tokens("alpha", image, None, (0, 0, 96, 64), (32, 48), False, 10**8)
    grid = whole.reshape(2, 3)  # 48x32 pixels: 3x2 tokens; the edge token half covered
    assert torch.equal(grid, torch.tensor([[0.0, 0.5, 1.0], [0.0, 0.5, 1.0]]))
    flipped = mask_tokens("alpha", image, None, (0, 0, 96, 64), (32, 48), True, 10**8).reshape(2, 3)
    assert torch.equal(flipped, grid.flip(1))
    right = mask_tokens("alpha", image, None, (48, 0, 96, 64), (32, 32), False, 10**8)
    assert torch.equal(right, torch.ones(4))  # a crop of the opaque half
    gray = _png(Image.fromarray(np.full((64, 96), 255, np.uint8), "L"))
    assert torch.equal(mask_tokens("file", image, gray, (0, 0, 96, 64), (32, 48), False, 10**8),
                       torch.ones(6))
    small = _png(Image.fromarray(np.zeros((10, 10), np.uint8), "L"))
    with pytest.raises(ValueError, match="is 10x10, the image 96x64: save the mask at the image's size"):
        mask_tokens("file", image, small, (0, 0, 96, 64), (32, 48), False, 10**8, "a.png")


def _masked_run(tmp, mode: str, left_black: bool = True):
    ds = make_kohya(tmp / "ds", {"1_a": [(64, 32)]})
    img = ds / "1_a" / "img_000.png"
    mask = np.full((32, 64), 255, np.uint8)
    if left_black:
        mask[:, :32] = 0
    Image.fromarray(mask, "L").save(img.with_name("img_000.mask.png"))
    params = _write_params(tmp, ds, train={"steps": 2, "checkpoint_every": 2},
                           caption={"text_drop": 0.0},
                           resolution={"mode": "keep", "aspect_range": [0.25, 4.0]})
    raw = yaml.safe_load(params.read_text())
    raw["data"]["datasets"][0]["mask"] = mode
    params.write_text(yaml.safe_dump(raw))
    return params, ds


def test_the_masked_half_of_an_image_has_exactly_zero_gradient(tmp_path):
    params, ds = _masked_run(tmp_path, "file")
    paths = _prepare(tmp_path, params)
    trainer = Trainer(load_params(params), paths)
    assert not any(f.name.endswith(".mask.png") for f in paths.catalog.rglob("*.png"))
    batch = trainer.batches.batch(0)
    batch, x = trainer.make_inputs(batch, 0)
    (h, w), = batch.hw.tolist()
    assert (h, w) == (2, 4) and x.loss_index is not None
    pred = trainer.model(x.z, x.text, x.sigma, x.layout).detach().requires_grad_(True)
    loss = flow_loss(pred, x.target, x.loss_seg, x.weight, x.n_image_tokens)
    loss.backward()
    cols = torch.arange(h * w) % w
    assert torch.count_nonzero(pred.grad[cols < w // 2]) == 0  # exactly zero
    assert torch.count_nonzero(pred.grad[cols >= w // 2]) == pred.grad[cols >= w // 2].numel()
    # the mask came from the latent cache (offline), keyed by its file's content
    assert trainer.caches.latents.store is not None
    assert len(trainer.caches.latents.store.index["entries"]) == 2  # the latents and the mask


def test_an_all_white_mask_trains_exactly_as_no_mask(tmp_path):
    params, _ = _masked_run(tmp_path / "m", "file", left_black=False)
    masked = Trainer(load_params(params), _prepare(tmp_path / "m", params)).run(progress=False)
    plain_params, _ = _masked_run(tmp_path / "p", "off", left_black=False)
    plain = Trainer(load_params(plain_params), _prepare(tmp_path / "p", plain_params)).run(progress=False)
    assert masked.losses == plain.losses


def test_a_dataset_mask_knob_names_its_choices(tmp_path):
    params, _ = _masked_run(tmp_path, "everywhere")
    with pytest.raises(ConfigError, match=r"datasets\[0\]\.mask.*one of off, auto, alpha, file"):
        load_params(params)


def test_the_weightings_by_noise_level():
    s = torch.tensor([0.1, 0.5, 0.9])
    assert torch.equal(sigma_weight(s, "none"), torch.ones(3))
    assert torch.allclose(sigma_weight(s, "min_snr", gamma=5.0),
                          torch.minimum((1 - s) ** 2, 5 * s ** 2))
    assert sigma_weight(torch.tensor([0.1]), "min_snr", gamma=1.0).item() == pytest.approx(0.01)
    grid = torch.linspace(1e-4, 1 - 1e-4, 200001, dtype=torch.float64)
    density = sigma_weight(grid, "logit_normal", mean=0.0, std=1.0).double()
    assert float(torch.trapezoid(density, grid)) == pytest.approx(1.0, abs=1e-3)  # a density
    assert float(sigma_weight(torch.tensor([0.5]), "logit_normal")) == pytest.approx(
        4 / math.sqrt(2 * math.pi), rel=1e-6)  # its peak at s = 1/2: 1/(sqrt(2 pi) * 1/4)
