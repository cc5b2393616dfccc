"""The tuner and the tuning table: the faster backend is picked, the table round-trips and is
only trusted when its bytes and its device signature match, the tuned dispatch calls each
shape bucket's backend and falls back (saying why once) when one raises, the compile backend
matches the reference, and `kmoss tune_kernels` writes a table on the CPU."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch
from typer.testing import CliRunner

from kohakumoss.diffusion.objective import OBJECTIVE
from kohakumoss.errors import IntegrityError
from kohakumoss.kernels import KernelRegistry, TunedOp, build_op_table, entry_key
from kohakumoss.kernels import table as table_mod
from kohakumoss.kernels import tuning
from kohakumoss.kernels.compiled import COMPILED, CompiledOp
from kohakumoss.kernels.problems import PROBLEMS, bucket, plan_calls, plan_problems
from kohakumoss.kernels.table import (KernelTable, device_signature, read_table, signature_key,
                                      winners, write_table)
from kohakumoss.model import FLAVORS, build_layout, ops
from kohakumoss.model.build import random_transformer
from kohakumoss.precision import precision_policy
from kohakumoss.training.engines import EnginePlan, tuned_kernels

from conftest import make_params

CPU = torch.device("cpu")
F32 = torch.float32
SITU = {"situ": {"N=24,F=8": {"N": 20, "F": 8}, "N=48,F=8": {"N": 40, "F": 8}}}


class Counting:
    """A test backend: the reference (or ``fn``), counting calls, optionally slow or failing."""

    def __init__(self, fn=ops.situ, sleep: float = 0.0, fail: bool = False):
        self.fn, self.sleep, self.fail, self.calls = fn, sleep, fail, 0

    def __call__(self, *args):
        self.calls += 1
        if self.fail:
            raise RuntimeError("this backend cannot run\nsecond line")
        if self.sleep:
            time.sleep(self.sleep)
        return self.fn(*args)


def _cpu(device, dtype):
    return device.type == "cpu"


def _registry(**backends) -> KernelRegistry:
    r = KernelRegistry()
    for name, fn in backends.items():
        r.register("situ", name, fn, _cpu)
    return r


def test_buckets_are_powers_of_two_and_one_and_a_half():
    assert [bucket(n) for n in (1, 16, 17, 24, 25, 8400, 16800, 16384)] == \
        [16, 16, 24, 24, 32, 12288, 24576, 16384]
    p = PROBLEMS["situ"]
    assert p.key(p.dims(torch.zeros(1000, 8), torch.zeros(1000, 8))) == "N=1024,F=8"


def test_plan_problems_follow_the_model():
    c = FLAVORS["tiny"]
    got = plan_problems(c, [[(100, 10), (50, 0)], [(30, 20)]])
    assert got["rms_norm"] == {"N=16,D=64": {"N": 10, "D": 64}, "N=24,D=64": {"N": 20, "D": 64}}
    assert got["gated_residual"]["N=192,D=64"] == {"N": 160, "D": 64, "B": 2}
    # joint blocks see image + text tokens, the final norm the image tokens (30 -> N=32)
    assert got["modulated_rms_norm"] == {"N=192,D=64": {"N": 160, "D": 64, "B": 2},
                                         "N=64,D=64": {"N": 50, "D": 64, "B": 1},
                                         "N=32,D=64": {"N": 30, "D": 64, "B": 1}}
    assert got["varlen_attention"]["N=192,L=128,H=2,Dh=32"]["S"] == 2


def test_plan_calls_are_the_calls_the_model_makes():
    """``plan_calls`` is the structure recorded from the model's own forward on the meta
    device (``call_structure``), at a batch's sizes: held here to what the tiny model's real
    forward calls on the CPU, op by op and bucket by bucket."""
    c = FLAVORS["tiny"]
    samples = [(12, 6), (10, 0), (1, 3)]
    layout = build_layout([(3, 4), (2, 5), (1, 1)], [6, 0, 3])
    model = random_transformer(c, "cpu")
    seen: dict[str, dict[str, int]] = {}

    def counting(op, fn):
        def call(*args, **kwargs):
            key = PROBLEMS[op].key(PROBLEMS[op].dims(*args, **kwargs))
            seen.setdefault(op, {})[key] = seen.get(op, {}).get(key, 0) + 1
            return fn(*args, **kwargs)
        return call

    objective = ops.OpTable(OBJECTIVE)
    for op in PROBLEMS:
        table = objective if op in OBJECTIVE else model.ops
        if op != "quant_linear":
            table.override(op, counting(op, getattr(table, op)))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        pred = model(torch.randn(layout.n_img, c.latent_channels, generator=g),
                     torch.randn(layout.n_txt, c.text_dim, generator=g), torch.rand(3, generator=g), layout)
        objective.flow_loss(pred, pred, layout.seg_img, torch.ones(3), layout.n_img, "mse", 1.0)
    assert seen == plan_calls(c, [samples])
    assert plan_calls(c, [samples, samples])["situ"] == {k: 2 * v for k, v in seen["situ"].items()}


def test_settle_weighs_a_backend_s_builds_against_the_run_s_calls():
    def entries(build_small: float):
        return {"situ/float32/N=24,F=8": {"ms": {"reference": 1.0, "compile": 0.5}, "order": [],
                                          "build_ms": {"reference": 0.0, "compile": 100.0}},
                "situ/float32/N=48,F=8": {"ms": {"reference": 2.0, "compile": 2.5}, "order": [],
                                          "build_ms": {"reference": 0.0, "compile": build_small}}}

    short, long = {"situ": {"N=24,F=8": 150, "N=48,F=8": 9}}, {"situ": {"N=24,F=8": 250}}
    got = entries(0.0)
    assert tuning.settle(got, short)  # saves 75 ms for 100 ms of build: the reference
    assert [e["order"][0] for e in got.values()] == ["reference", "reference"]
    assert got["situ/float32/N=24,F=8"]["demoted"] == {"compile": {"saved_ms": 75.0, "build_ms": 100.0}}
    assert not tuning.settle(got, short)  # settled already
    assert tuning.settle(got, long)  # 125 ms saved
    assert [e["order"][0] for e in got.values()] == ["compile", "reference"]
    got = entries(30.0)  # the builds of every shape the op is built for count
    tuning.settle(got, long)
    assert [e["order"][0] for e in got.values()] == ["reference", "reference"]
    assert not tuning.settle(got, None) and tuning.rank({"reference": 1.0, "compile": 0.5}) == \
        ["compile", "reference"]  # no plan: by time per call


def _slow_reference(monkeypatch, ms: float):
    def situ(u, g):
        time.sleep(ms / 1e3)
        return ops.situ(u, g)
    monkeypatch.setitem(tuning.REFERENCES, "situ", situ)


class Building(Counting):
    """A backend whose first call builds (sleeps ``build`` seconds), then runs fast."""

    def __init__(self, build: float):
        super().__init__()
        self.build = build

    def __call__(self, *args):
        if not self.calls:
            time.sleep(self.build)
        return super().__call__(*args)


def test_a_backend_whose_build_outweighs_a_short_run_loses_it_and_wins_a_long_one(tmp_path, monkeypatch):
    _slow_reference(monkeypatch, 2.0)
    builder = Building(0.3)
    r = _registry(builder=builder)
    one = {"situ": {"N=24,F=8": {"N": 20, "F": 8}}}
    key = "situ/float32/N=24,F=8"
    short = tuning.tune(one, CPU, F32, budget_s=60, registry=r, calls={"situ": {"N=24,F=8": 10}})
    entry = short.entries[key]
    assert entry["build_ms"]["builder"] >= 300 and entry["ms"]["reference"] >= 2.0
    assert entry["calls"] == 10 and entry["order"] == ["reference", "builder"]
    note = tuning.build_note(entry)
    assert note.startswith("builder is ") and "(0.3 s) costs more than the 0.0" in note
    # the stage keeps the measurement and re-ranks it for a longer plan: nothing is timed again
    builder = Building(0.3)  # a fresh process's
    r = _registry(builder=builder)
    section, _, _ = tuning.tune_table(tmp_path / "kernels", one, CPU, F32, budget_s=60, registry=r,
                                      calls={"situ": {"N=24,F=8": 10}}, params={}, inputs={})
    assert section["entries"][key]["order"][0] == "reference"
    builder.calls = 0
    section, result, _ = tuning.tune_table(tmp_path / "kernels", one, CPU, F32, budget_s=60, registry=r,
                                           calls={"situ": {"N=24,F=8": 1000}}, params={}, inputs={})
    assert not result.entries and builder.calls == 0
    assert section["entries"][key]["order"] == ["builder", "reference"]
    stored = read_table(tmp_path / "kernels").section(device_signature(CPU))["entries"][key]
    assert stored["order"] == ["builder", "reference"] and stored["calls"] == 1000
    assert tuning.build_note(stored) is None


def test_the_tuner_picks_the_faster_backend():
    slow, quick = Counting(sleep=0.05), Counting()
    r = _registry(slow=slow, quick=quick)
    result = tuning.tune(SITU, CPU, F32, budget_s=60, registry=r)
    assert result.complete and set(result.entries) == {"situ/float32/N=24,F=8", "situ/float32/N=48,F=8"}
    for entry in result.entries.values():
        assert entry["order"][-1] == "slow" and entry["ms"]["slow"] >= 50
        assert entry["shape"]["F"] == 8 and not entry["failed"]
    assert slow.calls and quick.calls
    table = r.build_op_table(CPU, F32, tuned=winners({"entries": result.entries}))
    slow.calls = 0
    table.situ(torch.randn(20, 8), torch.randn(20, 8))
    assert slow.calls == 0  # the slow one is never what a call runs


def test_rank_prefers_the_reference_within_the_margin():
    assert tuning.rank({"reference": 1.0, "a": 0.99, "b": 0.5, "c": 2.0}) == ["b", "reference", "a", "c"]


def test_a_failing_backend_is_recorded_not_ranked_and_the_budget_bounds_the_run(caplog):
    r = _registry(broken=Counting(fail=True))
    with caplog.at_level(logging.WARNING, "kohakumoss.kernels"):
        result = tuning.tune(SITU, CPU, F32, budget_s=60, registry=r)
    entry = result.entries["situ/float32/N=48,F=8"]
    assert entry["order"] == ["reference"] and "RuntimeError: this backend cannot run" in entry["failed"]["broken"]
    assert caplog.text.count("backend broken failed while tuning") == 1
    ticks = iter(range(100))  # a clock that moves one second per reading
    cut = tuning.tune(SITU, CPU, F32, budget_s=2, registry=_registry(quick=Counting()),
                      clock=lambda: next(ticks))
    assert len(cut.entries) < 2 and cut.untuned and not cut.complete


def _tuned_table(tmp_path, registry, problems=SITU, budget=60):
    return tuning.tune_table(tmp_path / "kernels", problems, CPU, F32, budget_s=budget,
                             params={"kernels.table": "auto"}, inputs={}, registry=registry)


def test_the_table_round_trips_and_a_rerun_measures_only_new_shapes(tmp_path):
    quick = Counting()
    r = _registry(quick=quick)
    section, result, manifest = _tuned_table(tmp_path, r)
    assert len(result.entries) == 2 and manifest.kind == "kernel_table"
    table = read_table(tmp_path / "kernels")
    assert table.section(device_signature(CPU)) == section
    assert section["tuning"]["first_run"]["measured"] == 2
    before = (tmp_path / "kernels" / "table.json").read_bytes()
    quick.calls = 0
    again, result, _ = _tuned_table(tmp_path, r)  # nothing new: nothing timed, same bytes
    assert not result.entries and quick.calls == 0
    assert (tmp_path / "kernels" / "table.json").read_bytes() == before
    more = {"situ": {**SITU["situ"], "N=96,F=8": {"N": 90, "F": 8}}}
    again, result, _ = _tuned_table(tmp_path, r, more)
    assert list(result.entries) == ["situ/float32/N=96,F=8"] and len(again["entries"]) == 3
    assert again["tuning"]["first_run"] == section["tuning"]["first_run"]


def test_a_changed_table_is_rejected(tmp_path, caplog):
    _tuned_table(tmp_path, _registry(quick=Counting()))
    path = tmp_path / "kernels" / "table.json"
    data = bytearray(path.read_bytes())
    data[data.index(b'"quick"') + 1] = ord("Q")  # one byte
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="table.json does not match its manifest.*not trusted"):
        read_table(tmp_path / "kernels")
    p = make_params([{"source": "kohya", "path": "ds"}], train={"dtype": "fp32"})
    plan = EnginePlan(CPU, precision_policy("fp32", full=False))
    with pytest.raises(IntegrityError):  # train refuses it
        tuned_kernels(p, plan, tmp_path / "kernels", FLAVORS["tiny"], [])
    with caplog.at_level(logging.WARNING, "kohakumoss.kernels"):  # the stage measures again
        section, result, _ = _tuned_table(tmp_path, _registry(quick=Counting()))
    assert "measuring everything again" in caplog.text and len(result.entries) == 2


def _foreign(tmp_path, **changes) -> None:
    """Re-sign this device's section of the table in ``tmp_path/kernels`` with ``changes``."""
    directory = tmp_path / "kernels"
    table = read_table(directory)
    section = table.devices.popitem()[1]
    section["signature"] = {**section["signature"], **changes}
    table.devices[signature_key(section["signature"])] = section
    write_table(directory, table, params={}, inputs={}, info={})


@pytest.mark.parametrize("changes, words", [
    ({"device": "cuda", "name": "NVIDIA H200", "arch": "sm90"},
     "it is for another device (NVIDIA H200 (cuda sm90); this is "),
    ({"kernels": "0.0.0+feedfeedfeedfeed"}, "with other kernel sources (kernels 0.0.0+feedfeed"),
    ({"flash_attn_4": "4.0.0b1"}, "with other software (flash_attn_4 4.0.0b1 there, "),
])
def test_a_foreign_table_is_not_used_and_the_log_says_so(tmp_path, caplog, changes, words):
    r = _registry(quick=Counting())
    section, _, _ = _tuned_table(tmp_path, r)
    assert any(order[0] == "quick" or order == ["reference", "quick"]
               for order in winners(section).values())
    _foreign(tmp_path, **changes)
    table = read_table(tmp_path / "kernels")  # its bytes are sound: the signature is what differs
    assert table.section(device_signature(CPU)) is None
    p = make_params([{"source": "kohya", "path": "ds"}], kernels={"retune_seconds": 0})
    plan = EnginePlan(CPU, precision_policy("fp32", full=False))
    with caplog.at_level(logging.WARNING, "kohakumoss.training"):
        tuned = tuned_kernels(p, plan, tmp_path / "kernels", FLAVORS["tiny"], [[(20, 4)]])
    assert tuned == {}  # nothing of it is used; no window to measure: the references
    assert "kernels/table.json is not used: " in caplog.text and words in caplog.text


def test_tuned_dispatch_per_bucket_and_the_nearest_shape_said_once(caplog):
    from kohakumoss.kernels.dispatch import BackendFailed

    a, b, small = Counting(), Counting(fail=True), Counting()
    r = _registry(a=a, b=b)
    r.register("situ", "small", small, _cpu, fits=lambda d: d["N"] <= 28)
    tuned = {entry_key("situ", F32, "N=16,F=8"): ["a", "reference"],
             entry_key("situ", F32, "N=32,F=8"): ["small", "a", "reference"],
             entry_key("situ", F32, "N=128,F=8"): ["b", "a"],
             entry_key("situ", F32, "N=64,F=8"): ["reference", "a"]}
    with caplog.at_level(logging.INFO, "kohakumoss.kernels"):
        table = r.build_op_table(CPU, F32, tuned=tuned)
    assert isinstance(table.situ.fn, TunedOp) and "situ=a on 1/4 shapes, b on 1/4 shapes, small on 1/4 shapes" in caplog.text

    def call(n):
        u, g = torch.randn(n, 8), torch.randn(n, 8)
        out = table.situ(u, g)
        assert torch.equal(out, ops.situ(u, g))

    call(10)
    assert (a.calls, b.calls, small.calls) == (1, 0, 0)
    caplog.clear()
    with caplog.at_level(logging.INFO, "kohakumoss.kernels"):
        call(30)  # small does not take N=30; a runs
        call(28)  # small takes N=28
        call(31)
        call(60)  # the reference (its entry ranks it first)
        call(40)  # no entry: the nearest measured shape's choice (N=64: the reference), said once
        call(41)
        call(20)  # no entry for N=24: N=32's chain is nearer than N=16's: small runs
    assert (a.calls, b.calls, small.calls) == (3, 0, 2)
    with pytest.raises(BackendFailed, match="situ: backend b failed at run time"):
        call(128)  # a backend that raises stops the run: no silent fall-back to a
    assert (a.calls, b.calls) == (3, 1)
    with caplog.at_level(logging.INFO, "kohakumoss.kernels"):
        u, g = torch.randn(10, 16), torch.randn(10, 16)
        assert torch.equal(table.situ(u, g), ops.situ(u, g))  # no entry with F=16 at all
    assert (a.calls, b.calls, small.calls) == (3, 1, 2)
    lines = [rec.getMessage() for rec in caplog.records]
    assert lines == ["situ: the tuning table has no entry for situ/float32/N=48,F=8; it follows "
                     "the one measured for N=64,F=8",
                     "situ: the tuning table has no entry for situ/float32/N=24,F=8; it follows "
                     "the one measured for N=32,F=8",
                     "situ: the tuning table has no entry for situ/float32/N=16,F=16 nor a shape "
                     "like it; it runs the reference"]
    assert table.situ.backend_for(torch.randn(30, 8), torch.randn(30, 8)) == "a"
    assert table.situ.backend_for(torch.randn(64, 8), torch.randn(64, 8)) == "reference"
    # the memory engines ask whether a call's backend keeps only its inputs: none of these does
    assert not table.situ.keeps_inputs_only_for(torch.randn(30, 8), torch.randn(30, 8))
    lean = _registry(lean=Counting())
    lean.register("situ", "lean2", Counting(), _cpu, keeps_inputs_only=True)
    t = lean.build_op_table(CPU, F32, tuned={entry_key("situ", F32, "N=16,F=8"): ["lean2", "lean"],
                                             entry_key("situ", F32, "N=32,F=8"): ["lean"]}).situ
    assert t.keeps_inputs_only_for(torch.randn(10, 8), torch.randn(10, 8))
    assert not t.keeps_inputs_only_for(torch.randn(30, 8), torch.randn(30, 8))
    assert not t.keeps_inputs_only_for(torch.randn(60, 8), torch.randn(60, 8))  # nearest: N=32
    # an entry naming no backend that can run here leaves the plain reference
    assert r.build_op_table(CPU, torch.bfloat16, tuned={entry_key("situ", F32, "N=16,F=8"): ["reference"]}).situ.fn is ops.situ


def test_a_compile_failure_at_run_time_is_an_error_naming_the_knob():
    """A tuned backend that fails in a run (the tuner never picks one that failed for it)
    stops the run with the op, the backend and ``kernels.backends``, not a silent fall-back."""
    from kohakumoss.kernels.dispatch import BackendFailed

    def data_dependent(u, g):  # a graph break: fullgraph compilation refuses it
        return ops.situ(u, g) if u.sum().item() > -1e9 else u

    r = KernelRegistry()
    r.register("situ", "compile", CompiledOp("situ", data_dependent, (0, 1)), _cpu)
    table = r.build_op_table(CPU, F32, tuned={entry_key("situ", F32, "N=16,F=8"): ["compile", "reference"]})
    u, g = torch.randn(10, 8), torch.randn(10, 8)
    with pytest.raises(BackendFailed, match="situ: backend compile failed at run time .*kernels.backends"):
        table.situ(u, g)


def test_the_compile_backend_matches_the_reference_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    for op, compiled in COMPILED.items():
        problem = PROBLEMS[op]
        dims = {"N": 37, "D": 64, "F": 64, "H": 2, "Dh": 32, "B": 3}
        for n in (37, 50):  # a second token count: no recompile needed, same results
            args = problem.make({**dims, "N": n}, F32, CPU, g, True)
            leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            want = ops.REFERENCE[op](*args)
            got = compiled(*args)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), op
            w = torch.randn(want.shape, generator=g)
            gw, gg = torch.autograd.grad(want, leaves, w), torch.autograd.grad(got, leaves, w)
            assert all(torch.allclose(x, y, rtol=1e-4, atol=1e-5) for x, y in zip(gg, gw)), op


def test_tune_kernels_writes_a_cpu_table(tmp_path, small_plan):
    from stages.cli import app

    params, plan = small_plan
    res = CliRunner().invoke(app, ["tune_kernels", "--params", str(params), "--plan", str(plan),
                                   "--out", str(tmp_path / "kernels")])
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "kernel table" in out and "(cpu " in out and "left untuned" in out
    assert "first-run tuning time: " in out
    table = read_table(tmp_path / "kernels")
    section = table.section(device_signature(CPU))
    assert section["tuning"]["first_run"]["budget_s"] == 0  # tune_seconds: 0 in small_plan
    manifest = json.loads((tmp_path / "kernels" / "manifest.json").read_text())
    assert manifest["kind"] == "kernel_table" and manifest["inputs"]["plan"]


@pytest.fixture
def small_plan(tmp_path):
    import yaml

    from kohakumoss.data.planfile import make_plan
    from kohakumoss.data.scan import scan
    from kohakumoss.params import load_params

    from conftest import BASE, make_kohya

    ds = make_kohya(tmp_path / "ds", {"1_a": [(48, 32), (32, 48)]})
    raw = {**BASE, "data": {**BASE["data"], "datasets": [{"source": "kohya", "path": str(ds)}]},
           "train": {"steps": 2, "device": "cpu", "dtype": "fp32"},
           "kernels": {"tune_seconds": 0}}
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    p = load_params(path)
    scan(p, tmp_path / "catalog")
    make_plan(p, tmp_path / "catalog", tmp_path / "plan")
    return path, tmp_path / "plan"


def test_the_table_module_is_what_train_reads():
    assert table_mod.KIND == "kernel_table" and KernelTable().why_not(device_signature(CPU)) == \
        "it holds no measurements"
    assert build_op_table(CPU, F32, tuned={}).situ.fn is ops.situ


# -- the stored tiny-run curve through a table on disk (the train stage's path) ------------------
def _every_bucket(backend: str) -> dict[str, list[str]]:
    """Entries naming ``backend`` for every elementwise op of the tiny model at every token
    bucket up to 4096: whatever a batch's shapes, each call dispatches through the table."""
    c = FLAVORS["tiny"]
    dims = {"D": c.dim, "F": c.ffn_dim, "H": c.heads, "Dh": c.head_dim}
    sizes = sorted({bucket(n) for n in range(1, 4097)})
    return {entry_key(op, F32, PROBLEMS[op].key({**dims, "N": n})): [backend, "reference"]
            for op in COMPILED for n in sizes}


def _table_run(tmp_path, entries: dict[str, list[str]]) -> list[float]:
    import dataclasses

    from kohakumoss.params import load_params
    from kohakumoss.training.build import build_components
    from kohakumoss.training.trainer import Trainer
    from test_train import TINY_RUNS, _prepare, _write_params

    from conftest import make_kohya

    section = {"signature": device_signature(CPU), "tuning": {},
               "entries": {k: {"order": v, "ms": {}, "failed": {}, "shape": {}} for k, v in entries.items()}}
    write_table(tmp_path / "kernels", KernelTable({signature_key(section["signature"]): section}),
                params={}, inputs={}, info={})
    ds = make_kohya(tmp_path / "ds", {"2_a": [(48, 32), (32, 48), (40, 40)], "1_b": [(64, 32)]})
    params = _write_params(tmp_path, ds, **TINY_RUNS["lora"], kernels={"retune_seconds": 0})
    p = load_params(params)
    paths = dataclasses.replace(_prepare(tmp_path, params), kernels=tmp_path / "kernels")
    components = build_components(p, paths)
    assert all(getattr(components.model.ops, op).wraps.fn.__class__ is TunedOp for op in COMPILED)
    return Trainer(p, paths, components).run(progress=False).losses


@pytest.fixture
def copies():
    """A backend ``copy`` of every elementwise op: its reference under another name."""
    from kohakumoss.kernels import KERNELS

    for op in COMPILED:
        KERNELS.register(op, "copy", Counting(ops.REFERENCE[op]), _cpu)
    yield
    for op in COMPILED:
        KERNELS.unregister(op, "copy")


def test_a_tiny_run_through_a_reference_table_gives_the_plain_curve_bit_for_bit(tmp_path, copies):
    from test_train import plain_lora_curve

    assert _table_run(tmp_path, _every_bucket("copy")) == plain_lora_curve(tmp_path / "plain")


@pytest.mark.slow  # ~1 min: every elementwise op compiled, with and without grad
def test_a_tiny_run_through_the_compile_table_gives_the_plain_curve_within_fp32_tolerance(tmp_path):
    from test_train import plain_lora_curve

    losses = _table_run(tmp_path, _every_bucket("compile"))
    stored = plain_lora_curve(tmp_path / "plain")
    assert torch.allclose(torch.tensor(losses, dtype=torch.float64),
                          torch.tensor(stored, dtype=torch.float64), rtol=1e-5, atol=0), \
        [(a, b) for a, b in zip(losses, stored)]


def test_an_adapter_run_times_the_activations_gradients_only():
    seen = []

    def rms(x, w, eps):
        seen.append((x.requires_grad, w.requires_grad))
        return ops.rms_norm(x, w, eps)

    r = KernelRegistry()
    r.register("rms_norm", "spy", rms, _cpu)
    problems = {"rms_norm": {"N=16,D=8": {"N": 16, "D": 8}}}
    frozen = tuning.tune(problems, CPU, F32, budget_s=60, weights_grad=False, registry=r)
    assert set(seen) == {(True, False)} and frozen.entries["rms_norm/float32/N=16,D=8"]["grads"] == "activations"
    seen.clear()
    full = tuning.tune(problems, CPU, F32, budget_s=60, weights_grad=True, registry=r)
    assert set(seen) == {(True, True)} and full.entries["rms_norm/float32/N=16,D=8"]["grads"] == "all"


def test_the_sampler_runs_the_kernels_the_table_chose_for_training_shapes(tmp_path, caplog):
    """``kmoss sample``/``grid`` build their DiT's table from the tuning table: a sampling
    shape the table lacks follows the nearest training shape measured; no table, another
    device's, or ``kernels.table: off`` leave the references (said why)."""
    from kohakumoss.training.engines import sampling_ops

    c = FLAVORS["tiny"]
    key = entry_key("situ", F32, PROBLEMS["situ"].key({"N": 48, "F": c.ffn_dim}))
    section = {"signature": device_signature(CPU), "tuning": {},
               "entries": {key: {"order": ["compile", "reference"], "ms": {}, "failed": {}, "shape": {}}}}
    write_table(tmp_path / "kernels", KernelTable({signature_key(section["signature"]): section}),
                params={}, inputs={}, info={})
    ds = [{"source": "kohya", "path": str(tmp_path / "ds")}]
    p = make_params(ds)
    table = sampling_ops(p, CPU, F32, tmp_path / "kernels")
    u, g = torch.randn(1000, c.ffn_dim), torch.randn(1000, c.ffn_dim)
    assert isinstance(table.situ.fn, TunedOp) and table.situ.backend_for(u, g) == "compile"
    assert table.rms_norm.fn is ops.rms_norm
    with caplog.at_level(logging.WARNING, "kohakumoss"):
        assert sampling_ops(p, CPU, F32, tmp_path / "none").situ.fn is ops.situ
    assert "no kernel tuning table in" in caplog.text
    off = make_params(ds, kernels={"table": "off"})
    assert sampling_ops(off, CPU, F32, tmp_path / "kernels").situ.fn is ops.situ


def test_a_norms_added_form_runs_through_either_dispatch_and_a_failing_one_is_an_error():
    """``ops.added_norm`` asks the table's norm for the call's backend's ``added`` form (the
    norm's own arguments come first: the tuned op buckets by them); the form's answer is
    used as it is; a form that raises stops the run, naming the form and the backend."""
    from kohakumoss.kernels.dispatch import BackendFailed

    made = []

    def norm(*args):
        return ops.modulated_rms_norm(*args)

    def added(x, w, shift, scale, seg, eps, y, gate):
        made.append(x.shape[0])
        s = ops.gated_residual(x, y, gate, seg)
        return ops.modulated_rms_norm(s, w, shift, scale, seg, eps), s

    def broken_added(*args):
        raise RuntimeError("no added form here")

    other = Counting(fn=ops.modulated_rms_norm)
    r = KernelRegistry()
    r.register("modulated_rms_norm", "fused", norm, _cpu, forms={"added": added})
    r.register("modulated_rms_norm", "other", other, _cpu, forms={"added": broken_added})
    g = torch.Generator().manual_seed(3)
    seg = torch.tensor([0] * 5 + [1] * 9)
    x, y = torch.randn(14, 8, generator=g), torch.randn(14, 8, generator=g)
    w, gate = torch.randn(8, generator=g), torch.randn(2, 8, generator=g)
    shift, scale = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
    s = ops.gated_residual(x, y, gate, seg)
    want = (ops.modulated_rms_norm(s, w, shift, scale, seg, 1e-6), s)
    tuned = {entry_key("modulated_rms_norm", F32, "N=16,D=8"): ["fused", "reference"],
             entry_key("modulated_rms_norm", F32, "N=32,D=8"): ["other", "reference"]}
    for table in (r.build_op_table(CPU, F32, tuned=tuned),
                  r.build_op_table(CPU, F32, {"modulated_rms_norm": ["fused"]})):
        made.clear()
        got = ops.added_norm(table.modulated_rms_norm, ops.gated_residual, x, y, gate, w, shift,
                             scale, seg, 1e-6)
        assert made == [14] and all(torch.equal(a, b) for a, b in zip(got, want))
    table = r.build_op_table(CPU, F32, {"modulated_rms_norm": ["other", "fused"]})
    with pytest.raises(BackendFailed, match="the added form of backend other failed at run time "
                                            r"\(RuntimeError: no added form here\)"):
        ops.added_norm(table.modulated_rms_norm, ops.gated_residual, x, y, gate, w, shift,
                       scale, seg, 1e-6)
    assert table.modulated_rms_norm.backend_for(x, w, shift, scale, seg, 1e-6) == "other"
    assert other.calls == 0
    # a table whose norm has no such form (the references) makes the two calls
    assert all(torch.equal(a, b) for a, b in zip(ops.added_norm(
        ops.modulated_rms_norm, ops.gated_residual, x, y, gate, w, shift, scale, seg, 1e-6), want))
