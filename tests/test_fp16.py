"""fp16 training (docs/precision.md): the residual stream carried at a power-of-two scale
(exactly undone by the norms), dynamic loss scaling that skips and recovers, and a tiny
fp16 run that trains the fp32 curve within tolerance."""

from __future__ import annotations

import pytest
import torch

from kohakumoss.adapters import apply_adapters
from kohakumoss.config import AdapterConfig
from kohakumoss.model import FLAVORS, build_layout, cast_model
from kohakumoss.model.build import tiny_transformer
from kohakumoss.params import load_params
from kohakumoss.precision.scaler import LossScaler
from kohakumoss.training.build import build_components
from kohakumoss.training.trainer import Trainer

from conftest import make_kohya
from test_train import _prepare, _write_params


def _inputs(c=FLAVORS["tiny"]):
    layout = build_layout([(3, 4), (2, 5)], [4, 6])
    g = torch.Generator().manual_seed(0)
    return (torch.randn(layout.n_img, c.latent_channels, generator=g),
            torch.randn(layout.n_txt, c.text_dim, generator=g), torch.rand(2, generator=g), layout)


def test_a_scaled_stream_is_exactly_the_plain_one_in_fp32():
    """Norms are scale-invariant with eps scaled by s^2, and s x + (s g) y = s (x + g y): a
    power-of-two scale changes no bit of the output or of the adapter's gradients."""
    results = []
    for s in (1.0, 2.0 ** -8, 2.0 ** 6):
        model = tiny_transformer()
        aset = apply_adapters(model, AdapterConfig(algo="lora", dim=4, alpha=4.0), seed=0)
        with torch.no_grad():
            for p in aset.trainable_parameters():
                p.add_(0.05)
        model.set_stream_scale(s)
        out = model(*_inputs())
        out.square().mean().backward()
        results.append((out.detach(), [p.grad.clone() for p in aset.trainable_parameters()]))
    for out, grads in results[1:]:
        assert torch.equal(out, results[0][0])
        assert all(torch.equal(a, b) for a, b in zip(grads, results[0][1]))
    with pytest.raises(ValueError, match="power of two"):
        tiny_transformer().set_stream_scale(0.3)


def test_an_fp16_stream_overflows_without_the_scale_and_not_with_it():
    """A stream whose sum over the blocks passes fp16's 65504 (here: the blocks' residual
    gates scaled up, so each adds a large branch) is inf in an fp16 forward; carried at 2^-8
    it stays finite and near the fp32 output."""
    big = tiny_transformer()
    D = big.config.dim
    with torch.no_grad():
        for chunk in (2, 5):  # gate_a and gate_f of the shared modulation [6 D]
            big.shared_block_modulation.weight[chunk * D:(chunk + 1) * D].mul_(3e4)
            big.shared_block_modulation.bias[chunk * D:(chunk + 1) * D].mul_(3e4)
        ref = big(*_inputs())
    assert ref.isfinite().all() and (ref.abs().max() > 0)
    half = cast_model(tiny_transformer(), torch.float16)
    half.load_state_dict({k: v.to(half.state_dict()[k].dtype) for k, v in big.state_dict().items()})
    img, txt, sigma, layout = _inputs()
    with torch.no_grad():
        plain = half(img.half(), txt.half(), sigma, layout)
        assert not torch.isfinite(plain).all()  # the overflow, shown
        half.set_stream_scale(2.0 ** -8)
        fixed = half(img.half(), txt.half(), sigma, layout)
    assert torch.isfinite(fixed).all()
    rel = ((fixed.float() - ref).norm() / ref.norm()).item()
    assert rel < 2e-2, rel


def test_the_scaler_skips_backs_off_and_grows_back():
    s = LossScaler(init_scale=8.0, growth_interval=2)
    t = torch.zeros(3, requires_grad=True)
    s.scaled(t.sum()).backward()
    assert torch.equal(t.grad, torch.full((3,), 8.0))
    s.unscale([t])
    assert torch.equal(t.grad, torch.ones(3))
    seen = []
    for finite in (True, False, True, True, True):
        s.update(finite)
        seen.append(s.scale)
    assert seen == [8.0, 4.0, 4.0, 8.0, 8.0] and s.skipped == 1
    again = LossScaler()
    again.load_state_dict(s.state_dict())
    assert again.state_dict() == s.state_dict()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp16")
    return tmp, make_kohya(tmp / "ds", {"2_a": [(48, 32), (32, 48), (40, 40)], "1_b": [(64, 32)]})


def _run(tmp, ds, name: str, **over):
    root = tmp / name
    root.mkdir()
    params = _write_params(root, ds, **over)
    p, paths = load_params(params), _prepare(root, params)
    trainer = Trainer(p, paths, build_components(p, paths))
    return trainer, trainer.run(progress=False)


def test_fp16_with_scaling_and_the_stream_fix_trains_the_fp32_curve(data):
    tmp, ds = data
    _, fp32 = _run(tmp, ds, "fp32", train={"steps": 8, "checkpoint_every": 8})
    # the tiny model's gradients times 2^16 overflow fp16 (the default scale backs off over
    # its first steps, as any dynamic scaler does): start where no step is skipped
    trainer, fp16 = _run(tmp, ds, "fp16", train={"steps": 8, "checkpoint_every": 8, "dtype": "fp16"},
                         precision={"init_scale": 1024})
    assert trainer.stepper.scaler.scale is not None and trainer.model.stream_scale == 2.0 ** -8
    assert not fp16.skipped_steps
    for a, b in zip(fp16.losses, fp32.losses):
        assert abs(a - b) <= 2e-2 * abs(b), (fp16.losses, fp32.losses)
    rows = trainer.log.rows
    assert all(r["loss_scale"] == 1024.0 for r in rows)  # no overflow: the scale stays


def test_an_injected_overflow_is_skipped_and_the_scale_recovers(data, monkeypatch):
    import kohakumoss.training.trainer as T

    calls = {"n": 0}
    real = T.flow_loss

    def overflowing(*args, **kwargs):
        calls["n"] += 1
        loss = real(*args, **kwargs)
        return loss * float("inf") if calls["n"] == 3 else loss  # step 3's gradients overflow

    monkeypatch.setattr(T, "flow_loss", overflowing)
    tmp, ds = data
    trainer, res = _run(tmp, ds, "overflow", train={"steps": 6, "checkpoint_every": 6, "dtype": "fp16"},
                        precision={"growth_interval": 2, "init_scale": 256})
    assert res.skipped_steps == [3]
    scales = [r["loss_scale"] for r in trainer.log.rows]
    assert scales == [256.0, 512.0, 256.0, 256.0, 512.0, 512.0], scales
    assert [r["skipped"] for r in trainer.log.rows] == [0, 0, 1, 0, 0, 0]


def test_sampling_in_fp16_carries_the_stream_scaled_and_matches_fp32(tmp_path):
    """The sampler takes the precision policy too: an fp16 sample is carried at 2^-8 (the
    params' precision.stream_scale), as an fp16 training step is, and stays near fp32's."""
    import numpy as np

    from kohakumoss.generate import Generator, Settings
    from conftest import make_params

    p = make_params([{"source": "kohya", "path": str(tmp_path)}],
                    encoders={"device": "cpu", "text_dtype": "fp32", "vae_dtype": "fp32"})
    half, full = (Generator(p, torch.device("cpu"), dt) for dt in (torch.float16, torch.float32))
    assert half.model.stream_scale == 2.0 ** -8 and full.model.stream_scale == 1.0
    assert half.policy.describe() == {"compute": "fp16", "weights": "fp16", "stream_scale": "0.00390625"}
    s = Settings(width=32, height=32, steps=4)
    a, b = (np.asarray(g.images(["kohaku, 2 red circles"], [0], s)[0], dtype=np.float64)
            for g in (half, full))
    assert np.abs(a - b).mean() < 2.0  # 8-bit levels
    q = make_params([{"source": "kohya", "path": str(tmp_path)}], precision={"stream_scale": 1},
                    encoders={"device": "cpu", "text_dtype": "fp32", "vae_dtype": "fp32"})
    assert Generator(q, torch.device("cpu"), torch.float16).model.stream_scale == 1.0
