"""Timestep samplers and the inference schedule."""

from __future__ import annotations

import pytest
import torch

from kohakumoss.diffusion.schedule import inference_sigmas
from kohakumoss.diffusion.timesteps import (TECH_REPORT, LogitNormalTimesteps, MossTimesteps,
                                            UniformTimesteps, batch_sigmas)
from kohakumoss.checks.parity import run_parity

from conftest import ROOT


def test_schedule_parity_with_vectors():
    res = {c.name: c for c in run_parity(ROOT / "tests" / "data" / "vectors")
           if c.name.startswith(("timesteps", "inference"))}
    # 3 tables + 1 draw set; 3 inference schedules, each stored and listed in config.json
    assert len(res) == 10 and all(c.passed for c in res.values())
    # bit for bit, on any x86 CPU: the tables come from MKL's reproducible (COMPATIBLE) path
    assert all(c.error == 0 for name, c in res.items() if name.startswith("timesteps"))


def test_sampler_tables_without_the_pinned_child(monkeypatch):
    """If the child cannot run, the tables come from this process, within float32 rounding."""
    from kohakumoss.diffusion import timesteps

    def fail(knobs):
        raise OSError("no fork here")

    knobs = dict(mu=-1.0, s=0.9, cutoff=None, uniform_mix=0.02, p_full=0.01, shift=2.0)
    ref_pmf, ref_sigma, ref_cdf = timesteps.moss_tables(**knobs)
    monkeypatch.setattr(timesteps, "_tables_in_pinned_child", fail)
    monkeypatch.setattr(timesteps, "_math_path_is_pinned", lambda: False)
    with pytest.warns(UserWarning, match="no fork here"):
        pmf, sigma, cdf = timesteps.moss_tables.__wrapped__(**knobs)
    assert torch.equal(sigma, ref_sigma)
    assert float((pmf - ref_pmf).norm() / ref_pmf.norm()) < 1e-5
    assert float((cdf - ref_cdf).abs().max()) < 1e-6


def test_moss_sampler_statistics_and_stages():
    pmf, sigma, _ = MossTimesteps().tables()
    assert abs(float(pmf.double().sum()) - 1) < 1e-6
    assert abs(float((pmf.double() * sigma.double()).sum()) - 0.744) < 1e-3  # noise-biased
    staged = MossTimesteps(schedule=TECH_REPORT)
    assert staged.knobs_at(0)["shift"] == 3.0 and staged.knobs_at(139_999)["mu"] == 0.0
    assert staged.knobs_at(300_000) == {"mu": -1.09, "s": 0.95, "cutoff": 0.95, "p_full": 0.0,
                                        "shift": 1.0, "uniform_mix": 0.01}
    means = [float((p.double() * s.double()).sum()) for p, s, _ in
             (staged.tables(t) for t in (0, 140_000, 207_000, 274_000))]
    assert [round(m, 3) for m in means] == [0.717, 0.768, 0.788, 0.744]


def test_draws_are_a_pure_function_of_seed_and_batch():
    s = MossTimesteps()
    a = batch_sigmas(s, 4, seed=3, global_batch=17, step=17)
    assert torch.equal(a, batch_sigmas(s, 4, seed=3, global_batch=17, step=17))
    assert not torch.equal(a, batch_sigmas(s, 4, seed=3, global_batch=18, step=18))
    for sampler in (UniformTimesteps(), LogitNormalTimesteps(), UniformTimesteps(shift=3.0)):
        x = batch_sigmas(sampler, 1000, 0, 0, 0)
        assert 0 < float(x.min()) and float(x.max()) <= 1
    assert float(batch_sigmas(UniformTimesteps(shift=3.0), 4000, 0, 0, 0).mean()) > 0.6


def test_inference_schedule_spec_values():
    sig = inference_sigmas(50, 5.0)
    expect = [1.000, .996, .992, .987, .983, .978, .973, .968, .963, .957, .952, .946, .939, .933,
              .926, .919, .912, .905, .897, .888, .880, .871, .861, .851, .840, .829, .817, .805,
              .791, .777, .762, .746, .729, .711, .692, .671, .648, .623, .597, .568, .536, .501,
              .463, .421, .373, .321, .261, .193, .115, .024, 0]
    assert [round(float(v), 3) for v in sig] == expect
    assert float(inference_sigmas(50, 1.0)[-2]) == torch.tensor(0.001).item()
