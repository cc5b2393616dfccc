"""Resolution planning against the numbers of ``docs/data.md#resolution``."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kohakumoss.config import ResolutionConfig
from kohakumoss.data.resolution import (Resolver, aspect_clamp, bucket_list, crop_size, fit,
                                        image_tokens, square_side)

MP = 1024 * 1024
SHIPPED = (0.33, 3.0)
MODES = ("resize", "bucket", "square", "crop", "keep")


def resolver(mode="resize", **kw) -> Resolver:
    kw.setdefault("aspect_range", SHIPPED)
    return Resolver(ResolutionConfig(mode=mode, **kw))


# -- bucket list (docs/data.md#buckets) ------------------------------------------------


@pytest.mark.parametrize("aspect, count, first, last", [
    ((0.25, 4.0), 97, (2048, 512), (512, 2048)),
    ((0.33, 3.0), 74, (1760, 592), (592, 1760)),
])
def test_bucket_list_counts(aspect, count, first, last):
    buckets = bucket_list(MP, 16, aspect)
    assert len(buckets) == count == len(set(buckets))
    assert buckets[0] == first and buckets[-1] == last
    for near_square in [(1040, 1008), (1024, 1024), (1008, 1040)]:
        assert near_square in buckets
    ratios = [w / h for h, w in buckets]
    assert ratios == sorted(ratios)
    for h, w in buckets:
        assert h % 16 == 0 and w % 16 == 0 and h * w <= MP
        assert aspect[0] <= w / h <= aspect[1]


def test_bucket_nearest_raw_aspect_and_small_sources():
    r = resolver("bucket")
    assert r.target(2048, 2048) == (1024, 1024)
    # raw aspect 10 lies outside the range: nearest extreme bucket, then cropped
    assert r.target(20000, 2000) == (592, 1760)
    assert r.target(2000, 20000) == (1760, 592)
    # smaller than its bucket with upscale never: own native fit target
    assert r.target(800, 600) == fit(800, 600, area=MP, step=16, aspect=SHIPPED, upscale=False)
    assert r.target(800, 600) == (592, 784)
    up = resolver("bucket", upscale="to_area")
    assert up.target(800, 600) in up.buckets
    assert up.target(800, 600) == min(up.buckets, key=lambda b: abs(math.log(b[1] / b[0])
                                                                     - math.log(800 / 600)))


def test_bucket_matches_bruteforce_argmin():
    r = resolver("bucket", aspect_range=(0.25, 4.0), upscale="to_area")
    logs = [math.log(w / h) for h, w in r.buckets]
    rng = np.random.default_rng(0)
    for w, h in rng.integers(16, 6000, size=(500, 2)).tolist() + [(1, 10000), (10000, 1)]:
        d = [abs(lg - math.log(w / h)) for lg in logs]
        assert r.target(w, h) == r.buckets[d.index(min(d))]


def test_empty_bucket_list_is_a_clear_error():
    with pytest.raises(ValueError, match="target_area"):
        resolver("bucket", target_area=256, size_step=32)


# -- fit and resize (docs/data.md#aspect-clamp-and-fit worked examples, #crop-box) ------


@pytest.mark.parametrize("w, h, target, tokens", [
    (1920, 1080, (768, 1360), 4080),
    (3000, 2000, (832, 1248), 4056),
    (800, 600, (592, 784), 1813),
    (4000, 1000, (576, 1728), 36 * 108),
    (512, 2048, (1536, 512), 96 * 32),
    (2048, 2048, (1024, 1024), 4096),
])
def test_worked_examples_resize(w, h, target, tokens):
    r = resolver("resize")
    assert r.target(w, h) == target
    assert image_tokens(*target) == tokens


def test_worked_example_centre_box():
    r = resolver("resize")
    th, tw = r.target(1920, 1080)
    box = r.crop_box(1920, 1080, th, tw, None)
    assert box == (4, 0, 1916, 1080)
    assert r.resizes(1920, 1080, box, th, tw)


def test_aspect_clamp():
    assert aspect_clamp(4000, 1000, SHIPPED) == (3000, 1000)
    assert aspect_clamp(512, 2048, SHIPPED) == (512, 1552)
    assert aspect_clamp(800, 600, SHIPPED) == (800, 600)
    assert aspect_clamp(10000, 1, SHIPPED) == (3, 1)
    assert aspect_clamp(1, 10000, SHIPPED) == (1, 3)


def test_exact_divisibility_keeps_size_without_resampling():
    for mode in ("resize", "bucket", "crop", "keep"):
        r = resolver(mode)
        assert r.target(1024, 1024) == (1024, 1024)
        box = r.crop_box(1024, 1024, 1024, 1024, None)
        assert box == (0, 0, 1024, 1024)
        assert not r.resizes(1024, 1024, box, 1024, 1024)


def test_no_upscale_vs_to_area():
    never = resolver("resize")
    to_area = resolver("resize", upscale="to_area")
    assert never.target(512, 512) == (512, 512)
    assert to_area.target(512, 512) == (1024, 1024)
    assert never.target(640, 480) == (480, 640)
    th, tw = to_area.target(640, 480)
    assert th * tw <= MP and th * tw > 0.9 * MP and abs(tw / th - 4 / 3) < 0.02


@pytest.mark.parametrize("w, h", [(1, 10000), (10000, 1), (1, 1), (15, 15), (16, 16)])
@pytest.mark.parametrize("mode", MODES)
def test_extreme_and_tiny_sources(mode, w, h):
    r = resolver(mode)
    th, tw = r.target(w, h)
    assert th >= 16 and tw >= 16 and th % 16 == 0 and tw % 16 == 0
    assert SHIPPED[0] <= tw / th <= SHIPPED[1]
    for rng in (None, np.random.default_rng(1)):
        left, top, right, bottom = r.crop_box(w, h, th, tw, rng)
        assert 0 <= left < right <= w and 0 <= top < bottom <= h


def test_tiny_sources_upscale_in_every_mode():
    for mode in MODES:
        r = resolver(mode)
        th, tw = r.target(15, 15)
        assert r.resizes(15, 15, r.crop_box(15, 15, th, tw, None), th, tw)
    for mode in ("resize", "crop", "keep"):
        r = resolver(mode)
        assert r.target(16, 16) == (16, 16)
        assert not r.resizes(16, 16, r.crop_box(16, 16, 16, 16, None), 16, 16)


# -- square (docs/data.md#square-crop-and-keep) -----------------------------------------


def test_square_and_shifted_square():
    r = resolver("square", upscale="to_area")
    assert square_side(MP, 16) == 1024 and square_side(1000, 32) == 32
    assert not r.random_crop
    assert r.target(1920, 1080) == r.target(300, 200) == (1024, 1024)
    assert r.crop_box(1920, 1080, 1024, 1024, None) == (420, 0, 1500, 1080)
    assert resolver("square").target(300, 200) == (1024, 1024)  # upscale ignored
    shifted = resolver("square", crop="random")
    assert shifted.random_crop
    boxes = {shifted.crop_box(1920, 1080, 1024, 1024, np.random.default_rng(s)) for s in range(20)}
    assert len(boxes) > 1
    for left, top, right, bottom in boxes:
        assert (right - left, bottom - top) == (1080, 1080) and top == 0 and 0 <= left <= 840


# -- crop and keep -----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["crop", "keep"])
@pytest.mark.parametrize("w, h", [(1920, 1080), (3000, 2000), (800, 600), (4000, 1000),
                                  (512, 2048), (17, 33), (5000, 16)])
def test_crop_and_keep_never_resample(mode, w, h):
    for crop in ("center", "random"):
        r = resolver(mode, crop=crop)
        th, tw = r.target(w, h)
        assert th <= h and tw <= w
        rng = np.random.default_rng(3) if r.random_crop else None
        box = r.crop_box(w, h, th, tw, rng)
        assert (box[2] - box[0], box[3] - box[1]) == (tw, th)
        assert not r.resizes(w, h, box, th, tw)


def test_crop_is_fit_without_upscale_and_keep_has_no_area_limit():
    crop = resolver("crop", upscale="to_area")
    assert crop.target(1920, 1080) == (768, 1360)
    assert crop.target(640, 480) == (480, 640)
    keep = resolver("keep")
    assert keep.target(4096, 3072) == (3072, 4096)
    assert keep.target(4000, 3000) == (2992, 4000)
    assert keep.target(1920, 1080) == (1072, 1920)
    assert keep.target(4000, 1000) == (992, 2976)  # clamp to 3000x1000, step, aspect pass
    assert keep.crop_box(1920, 1080, 1072, 1920, None) == (0, 4, 1920, 1076)


# -- random crops --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_random_crop_inside_and_reproducible(mode):
    r = resolver(mode, crop="random", upscale="to_area")
    assert r.random_crop
    for w, h in [(1920, 1080), (777, 3001), (4000, 1000), (20, 9)]:
        th, tw = r.target(w, h)
        a = r.crop_box(w, h, th, tw, np.random.default_rng(42))
        b = r.crop_box(w, h, th, tw, np.random.default_rng(42))
        assert a == b
        assert 0 <= a[0] < a[2] <= w and 0 <= a[1] < a[3] <= h


def test_random_crop_draws_left_then_top():
    r = resolver("resize", crop="random")
    g = np.random.default_rng(7)
    box = r.crop_box(1920, 1080, 768, 1360, g)
    ref = np.random.default_rng(7)
    assert box[0] == ref.integers(0, 1920 - 1912 + 1) and box[1] == ref.integers(0, 1)


# -- vectorised targets ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_targets_matches_scalar(mode):
    rng = np.random.default_rng(0)
    w = rng.integers(256, 4096, size=100_000)
    h = rng.integers(256, 4096, size=100_000)
    w[:50_000] = rng.choice([1024, 1920, 832, 2048, 1216], size=50_000)
    h[:50_000] = rng.choice([1024, 1080, 1216, 1536, 832], size=50_000)
    typical_w, typical_h = w[:50_000], h[:50_000]
    r = resolver(mode)
    th, tw = r.targets(typical_w, typical_h)
    assert th.dtype == tw.dtype == np.int64
    th, tw = r.targets(w, h)  # 50k distinct-ish sizes still work
    for i in rng.integers(0, 100_000, size=300).tolist():
        assert (th[i], tw[i]) == r.target(int(w[i]), int(h[i]))
    e_h, e_w = r.targets(np.array([], np.int64), np.array([], np.int64))
    assert e_h.shape == (0,) and e_w.shape == (0,)


def test_bad_sizes_raise():
    r = resolver("resize")
    with pytest.raises(ValueError, match="rejected rows"):
        r.target(0, 0)
    with pytest.raises(ValueError, match="index 1"):
        r.targets(np.array([10, 0]), np.array([10, 0]))


# -- properties ------------------------------------------------------------------------------

configs = st.builds(
    lambda mode, step, area, lo, hi, upscale, crop: ResolutionConfig(
        mode=mode, size_step=step, target_area=area, aspect_range=(lo, hi), upscale=upscale,
        crop=crop),
    st.sampled_from(MODES), st.sampled_from([16, 32, 64]),
    st.integers(256, 4 * MP), st.floats(0.2, 1.0), st.floats(1.0, 5.0),
    st.sampled_from(["never", "to_area"]), st.sampled_from(["center", "random"]))
sides = st.integers(1, 12000)


@settings(max_examples=400, deadline=None)
@given(cfg=configs, w=sides, h=sides, seed=st.integers(0, 2**32))
def test_property_targets_and_boxes(cfg, w, h, seed):
    try:
        r = Resolver(cfg)
    except ValueError:  # a bucket config with no bucket at all
        assert cfg.mode == "bucket" and not bucket_list(cfg.target_area, cfg.size_step,
                                                        cfg.aspect_range)
        return
    step, (lo, hi) = cfg.size_step, cfg.aspect_range
    th, tw = r.target(w, h)
    assert th % step == 0 and tw % step == 0 and th >= step and tw >= step
    assert lo <= tw / th <= hi
    if cfg.mode in ("resize", "crop", "bucket", "square") and min(th, tw) > step:
        assert th * tw <= cfg.target_area  # only a side bumped up to one step may exceed it
    if min(th, tw) > step:  # no side was bumped up to one step: never upscaled
        cw, ch = aspect_clamp(w, h, cfg.aspect_range)
        if cfg.mode in ("crop", "keep"):
            assert th <= ch <= h and tw <= cw <= w
        elif cfg.mode == "resize" and cfg.upscale == "never":
            assert th * tw <= cw * ch
        elif cfg.mode == "bucket" and cfg.upscale == "never":
            assert th * tw <= w * h
    rng = np.random.default_rng(seed) if r.random_crop else None
    box = r.crop_box(w, h, th, tw, rng)
    left, top, right, bottom = box
    assert 0 <= left < right <= w and 0 <= top < bottom <= h
    if cfg.mode in ("crop", "keep") and th <= h and tw <= w:
        assert (right - left, bottom - top) == (tw, th) and not r.resizes(w, h, box, th, tw)
    if cfg.mode in ("resize", "bucket", "square"):
        assert (right - left, bottom - top) == crop_size(w, h, th, tw)
