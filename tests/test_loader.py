"""The loader: decode rules, plan order for any worker count, exact resume, broken files."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from kohakumoss.data.loader import PlanBatches, decode_image, make_loader, to_model_range
from kohakumoss.data.planfile import make_plan
from kohakumoss.data.scan import scan

from conftest import make_params


def _png(arr: np.ndarray, mode: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr, mode).save(buf, format="PNG")
    return buf.getvalue()


def test_decode_crop_resize_flip():
    arr = np.zeros((40, 60, 3), np.uint8)
    arr[:, :30] = 255  # left half white
    out = decode_image(_png(arr, "RGB"), (0, 0, 60, 40), (40, 60), flip=False)
    assert out.shape == (40, 60, 3) and out[0, 0, 0] == 255 and out[0, -1, 0] == 0
    flipped = decode_image(_png(arr, "RGB"), (0, 0, 60, 40), (40, 60), flip=True)
    assert np.array_equal(flipped, out[:, ::-1])
    crop = decode_image(_png(arr, "RGB"), (30, 0, 60, 40), (16, 16), flip=False)
    assert crop.shape == (16, 16, 3) and crop.max() == 0


def test_decode_alpha_over_background_and_exif():
    rgba = np.zeros((16, 16, 4), np.uint8)  # fully transparent black
    for bg, value in (("white", 255), ("black", 0), ("gray", 127), ((10, 20, 30), 10)):
        out = decode_image(_png(rgba, "RGBA"), (0, 0, 16, 16), (16, 16), False, background=bg)
        assert out[0, 0, 0] == value
    # a 32x16 image stored sideways with EXIF orientation 6 decodes upright as 16x32
    img = Image.new("RGB", (32, 16), (255, 0, 0))
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    img.save(buf, format="JPEG", exif=exif)
    out = decode_image(buf.getvalue(), (0, 0, 16, 32), (32, 16), False)
    assert out.shape == (32, 16, 3)


def test_model_range():
    x = to_model_range(np.array([[[0, 255, 127]]], np.uint8))
    assert x.shape == (3, 1, 1) and x.dtype == torch.float32
    assert torch.allclose(x.flatten(), torch.tensor([-1.0, 1.0, 127 / 127.5 - 1]))


@pytest.fixture
def planned(tmp_path, kohya_dataset):
    p = make_params([{"source": "kohya", "path": str(kohya_dataset)}],
                    train={"steps": 9}, resolution={"flip": True, "crop": "random", "mode": "crop"})
    scan(p, tmp_path / "catalog")
    make_plan(p, tmp_path / "catalog", tmp_path / "plan")
    return p, PlanBatches(tmp_path / "plan", p.data.datasets, p.resolution, tmp_path / "catalog")


def _digest(batches):
    return [(b.index, b.uids.tolist(), b.captions, [float(x.sum()) for x in b.pixels],
             [tuple(x.shape) for x in b.pixels]) for b in batches]


def test_resume_equals_uninterrupted_for_any_worker_count(planned):
    _, pb = planned
    assert len(pb) == 9
    full = _digest(make_loader(pb, num_workers=0))
    assert [d[0] for d in full] == list(range(9))
    assert _digest(make_loader(pb, num_workers=2)) == full
    resumed = _digest(make_loader(pb, start=4, num_workers=2))
    assert resumed == full[4:]
    b = pb.batch(3)
    assert all(tuple(px.shape[1:]) == (int(h) * 16, int(w) * 16) for px, (h, w) in zip(b.pixels, b.hw))
    assert all(-1.0 <= float(px.min()) and float(px.max()) <= 1.0 for px in b.pixels)


def test_ranks_interleave(tmp_path, kohya_dataset):
    p = make_params([{"source": "kohya", "path": str(kohya_dataset)}], train={"steps": 3},
                    parallel={"world_size": 2})
    scan(p, tmp_path / "catalog")
    make_plan(p, tmp_path / "catalog", tmp_path / "plan")
    ranks = [PlanBatches(tmp_path / "plan", p.data.datasets, p.resolution, tmp_path / "catalog",
                         rank=r, world=2) for r in (0, 1)]
    assert [len(r) for r in ranks] == [3, 3]
    assert ranks[1].batch(2).rank == 1
    with pytest.raises(IndexError, match="re-run `kmoss plan`"):
        ranks[0].batch(3)


def test_broken_image_is_skipped_not_fatal(planned, kohya_dataset, caplog):
    _, pb = planned
    victim = kohya_dataset / "3_alpha" / "img_000.png"
    victim.write_bytes(victim.read_bytes()[:60])  # truncated after the scan
    seen_skip = False
    for b in make_loader(pb, num_workers=0):
        for uid, reason in b.skipped:
            seen_skip = True
            assert "img_000.png" in reason
        assert len(b.pixels) == len(b.captions) == len(b.uids)
    assert seen_skip
