"""The memory catalog (`kmoss profiles`): every valid combination of the memory engines with
the estimator's peaks, the named profiles among its rows at their own estimates."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from typer.testing import CliRunner

from kohakumoss.memory.profiles import PROFILE_ENGINES, MemoryEngines
from kohakumoss.model import FLAVORS
from kohakumoss.params import load_params
from kohakumoss.training.catalog import accepted, catalog, fitting
from kohakumoss.training.estimate import estimate, placed
from stages.cli import app

from conftest import ROOT

ONE_MP = [(4096, 104)]  # one 1 MP sample a step: the 6 and 8 GB presets' budget


@pytest.fixture(scope="module")
def published():
    """The repository's params on the published-size DiT with a rank-32 LoRA in bf16."""
    p = load_params(ROOT / "params.yaml")
    p = dataclasses.replace(p, train=dataclasses.replace(p.train, dtype="bf16"),
                            adapter=dataclasses.replace(p.adapter, dim=32, alpha=32))
    return p, catalog(p, ONE_MP, FLAVORS["base"])


def test_the_catalog_at_the_published_size_holds_the_named_profiles_at_their_estimates(published):
    p, rows = published
    assert len(fitting(rows, vram=8)) >= 100  # kmoss profiles --vram 8
    assert all(r.peak <= 8 * 2**30 for r in fitting(rows, vram=8))
    assert [r.speed for r in rows] == sorted((r.speed for r in rows), reverse=True)
    assert len({(r.engines, r.base) for r in rows}) == len(rows)  # each combination once
    cuda = torch.device("cuda")
    for name in PROFILE_ENGINES:
        q = dataclasses.replace(p, profile=name)
        engines = placed(PROFILE_ENGINES[name], q, cuda)[0]
        row, = [r for r in rows if r.name == name]
        est = estimate(q, ONE_MP, engines, FLAVORS["base"])
        assert row.engines == engines and (row.peak, row.host) == (est.peak, est.host), name
        assert row.measured and row.base == "keep"
    # every row's peak is the estimator's for that manual profile
    for r in rows[::37]:
        q = dataclasses.replace(p, profile="manual",
                                precision=dataclasses.replace(p.precision, base=r.base))
        assert estimate(q, ONE_MP, r.engines, FLAVORS["base"]).peak == r.peak


def test_what_params_refuse_is_not_a_row(published):
    p, rows = published
    assert not accepted(p, MemoryEngines("block", rebuild=True), "keep")  # rebuild: none/partial
    assert not accepted(p, MemoryEngines("none", offload=True), "keep")  # offload: block/sub-block
    assert not accepted(p, MemoryEngines("block", stream_slots=2), "int8")  # a quantized base streams not
    assert not accepted(p, MemoryEngines("none", optimizer="fused"), "keep")  # grad_clip 1.0
    assert all(r.engines.optimizer != "fused" for r in rows)
    assert all(not (r.engines.stream_slots and r.base != "keep") for r in rows)


def test_kmoss_profiles_filters_by_card_and_ram():
    res = CliRunner().invoke(app, ["profiles", "--params", str(ROOT / "params.yaml"),
                                   "--vram", "8", "--ram", "32", "--plan", "no-plan"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "valid combinations fit a 8 GiB card, 32 GiB RAM" in text
    assert "speed" in text and "minimal" in text and "x speed" in text
