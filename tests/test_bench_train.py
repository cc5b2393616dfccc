"""``bench/bench_train.py`` times the library's own run: its params file with ``-S``
overrides, the profile ``resolve_profile`` picks, the model side ``build_training`` builds
and ``Trainer.step``; it holds no module-level mutable state. On the CPU with the tiny
flavor, the same path the GPU measurements take."""

from __future__ import annotations

import ast
import sys

import pytest

from conftest import ROOT

BENCH = ROOT / "bench" / "bench_train.py"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    sys.modules.pop("bench_train", None)
    import bench_train

    return bench_train


def test_the_bench_has_no_module_level_mutable_state():
    tree = ast.parse(BENCH.read_text(encoding="utf-8"))
    mutable = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
    found = [ast.unparse(n) for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
             and isinstance(n.value, mutable)]
    assert found == []
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)]


def test_overrides_set_keys_and_are_checked_as_a_run_checks_them(bench):
    raw = {"adapter": {"dim": 4}}
    bench.override(raw, "adapter.dim=32")
    bench.override(raw, "precision.fp8_compute=fast")
    bench.override(raw, "profile=minimal")
    assert raw == {"adapter": {"dim": 32}, "precision": {"fp8_compute": "fast"}, "profile": "minimal"}
    with pytest.raises(SystemExit, match="expected section.key=value"):
        bench.override(raw, "adapter.dim")
    from kohakumoss.configlib import ConfigError

    with pytest.raises(ConfigError, match="fp8_compute"):  # fp8 GEMMs need an fp8 base
        bench.bench_params(bench.PARAMS, ["precision.fp8_compute=on", "train.device=cpu"])


def test_a_tiny_run_on_the_cpu_goes_through_the_trainers_step(bench, monkeypatch, tmp_path):
    from kohakumoss.training.trainer import Trainer

    steps = []
    real = Trainer.step
    monkeypatch.setattr(Trainer, "step", lambda self, step, ahead: steps.append(step) or real(self, step, ahead))
    monkeypatch.setenv("OUT", str(tmp_path))
    res = bench.main(["--flavor", "tiny", "--grid", "2", "--text", "3", "--budgets", "20", "--steps", "2",
                      "-S", "train.device=cpu", "-S", "train.dtype=fp32",
                      "--variant", "", "--variant", "profile=manual memory.checkpointing=block"])
    plain, block = res["runs"]
    assert steps == [0, 1, 2, 3] * 2
    assert plain["memory"].startswith("checkpointing none") and "checkpointing block" in block["memory"]
    assert plain["budget_samples"] == block["budget_samples"] == 2  # 20 tokens: two of 2x2 + 3 (+3)
    assert all(r["samples_per_s"] > 0 and r["trainable_params"] > 0 for r in res["runs"])
    assert (tmp_path / "bench_train.json").is_file()
