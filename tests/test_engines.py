"""Engines applied from outside in one order (precision, kernels, memory): what each step
leaves, the precision policy, the layering of the packages, and a tiny training run with
every engine on that still gives the stored loss curve bit for bit."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from kohakumoss.kernels import KERNELS
from kohakumoss.memory import ELEMENTWISE
from kohakumoss.model import FLAVORS, build_layout, cast_model
from kohakumoss.model import ops
from kohakumoss.model.build import tiny_transformer
from kohakumoss.model.dit import FP32_MODULES
from kohakumoss.precision import precision_policy
from kohakumoss.memory.profiles import MemoryEngines
from kohakumoss.training.engines import EnginePlan, apply_engines, engine_plan

from conftest import ROOT, make_params

CPU = torch.device("cpu")


@pytest.fixture
def test_backend():
    """``rms_norm`` backend ``test`` in the process registry (the reference, counted), which
    can run on the CPU in any float dtype; removed afterwards."""
    calls = []

    def rms_norm_test(x, weight, eps):
        calls.append(x.dtype)
        return ops.rms_norm(x, weight, eps)

    KERNELS.register("rms_norm", "test", rms_norm_test, lambda device, dtype: device.type == "cpu")
    yield rms_norm_test, calls
    KERNELS.unregister("rms_norm", "test")


# -- precision -------------------------------------------------------------------------------
def test_precision_policy_full_and_adapter():
    full, adapter = precision_policy("bf16", full=True), precision_policy("bf16", full=False)
    assert (full.compute, full.weights) == (torch.bfloat16, torch.float32)  # fp32 masters
    assert (adapter.compute, adapter.weights) == (torch.bfloat16, torch.bfloat16)  # frozen base
    with full.autocast(CPU):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with precision_policy("fp32", full=True).autocast(CPU):
        assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(ValueError, match="train dtype 'fp64' is not one of bf16, fp16, fp32"):
        precision_policy("fp64", full=True)


def test_engine_plan_reads_train_dtype_and_adapter_full():
    ds = [{"source": "kohya", "path": "ds"}]
    lora = engine_plan(make_params(ds, adapter={"algo": "lora"}, train={"dtype": "bf16"}), CPU)
    full = engine_plan(make_params(ds, adapter={"algo": "full"}, train={"dtype": "bf16"}), CPU)
    assert lora.precision.weights == torch.bfloat16 and full.precision.weights == torch.float32
    assert lora.memory.recompute and lora.memory.checkpointing == "none" and not lora.kernels


# -- the order ---------------------------------------------------------------------------------
def test_apply_engines_in_order(test_backend):
    backend, calls = test_backend
    model = tiny_transformer()
    plan = EnginePlan(CPU, precision_policy("bf16", full=False), kernels={"rms_norm": "test"},
                      memory=MemoryEngines("block"))
    applied = apply_engines(model, plan)
    # 1. precision: the base in bf16, the declared fp32 modules kept in fp32
    assert model.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for n in FP32_MODULES
               for p in model.get_submodule(n).parameters())
    # 2. kernels, then 3. recompute wrapping what step 2 chose, then block checkpointing
    assert [b.fn for b in model.ops.rms_norm.wraps.fn.backends] == [backend]
    assert applied.recomputed == list(ELEMENTWISE)
    assert applied.kernels["rms_norm"] == "recomputed(chosen(rms_norm: test, reference))"
    assert applied.checkpointed == [f"text_embedder.blocks.{i}" for i in range(2)] + \
        [f"layers.{i}" for i in range(FLAVORS["tiny"].depth)]
    assert applied.precision == {"compute": "bf16", "weights": "bf16"}
    other = tiny_transformer()
    assert other.ops.rms_norm.fn is ops.rms_norm  # another model is untouched


def test_every_engine_together_keeps_the_math(test_backend):
    _, calls = test_backend
    hw, lens = [(3, 4), (2, 5)], [4, 6]
    layout = build_layout(hw, lens)
    g = torch.Generator().manual_seed(0)
    c = FLAVORS["tiny"]
    args = (torch.randn(layout.n_img, c.latent_channels, generator=g),
            torch.randn(layout.n_txt, c.text_dim, generator=g), torch.rand(2, generator=g))

    def run(model):
        out = model(*args, layout)
        out.float().square().mean().backward()
        return out, [p.grad for p in model.parameters()]

    plain = run(cast_model(tiny_transformer(), torch.bfloat16))
    model = tiny_transformer()
    apply_engines(model, EnginePlan(CPU, precision_policy("bf16", full=False),
                                    kernels={"rms_norm": "test"}, memory=MemoryEngines("block")))
    engined = run(model)
    assert calls and set(calls) == {torch.bfloat16}
    assert torch.equal(engined[0], plain[0])
    assert all(torch.equal(a, b) for a, b in zip(engined[1], plain[1]))


@pytest.mark.parametrize("memory", [MemoryEngines("block"), MemoryEngines("sub-block"),
                                    MemoryEngines("selective"), MemoryEngines("partial", 1),
                                    MemoryEngines("none", rebuild=True),
                                    MemoryEngines("partial", 1, rebuild=True),
                                    MemoryEngines("none", stream_slots=1, rebuild=True),
                                    MemoryEngines("block", stream_slots=2),
                                    MemoryEngines("none", stream_slots=1),
                                    MemoryEngines("block", stream_slots=2, optimizer="host"),
                                    MemoryEngines("block", stream_slots=2, optimizer="host", offload=True),
                                    MemoryEngines("sub-block", stream_slots=2, optimizer="host", offload=True)],
                         ids=lambda m: m.checkpointing + ("-rebuild" if m.rebuild else "")
                         + (f"-stream{m.stream_slots}" if m.stream_slots else "")
                         + ("-host" if m.optimizer == "host" else "") + ("-offload" if m.offload else ""))
def test_a_tiny_run_with_every_engine_gives_the_stored_curve(tmp_path, test_backend, memory):
    """Every checkpointing mode and weight streaming (what the profiles choose between)
    trains the plain run's curve bit for bit (and the stored one, within round-off across
    CPUs), with a kernel backend and recomputation applied
    too (streaming on the CPU here: the same ring, copies without a side stream)."""
    import json

    from test_train import LOSSES, STORED_REL, _tiny_run_losses, plain_lora_curve

    _, calls = test_backend
    plan = EnginePlan(CPU, precision_policy("fp32", full=False), kernels={"rms_norm": "test"},
                      memory=memory)
    losses = _tiny_run_losses(tmp_path / "engined", "lora", engines=plan)
    assert calls  # the backend ran
    plain = plain_lora_curve(tmp_path / "plain")
    assert losses == plain  # bit for bit, on this machine
    assert losses == pytest.approx(json.loads(LOSSES.read_text())["lora"], rel=STORED_REL["fp32"])




# -- layering ----------------------------------------------------------------------------------
ALLOWED = {  # package -> the kohakumoss modules it may import (besides its own)
    "model": ("kohakumoss.errors",),
    "kernels": ("kohakumoss.errors", "kohakumoss.model", "kohakumoss.diffusion.objective",
                "kohakumoss.artifacts", "kohakumoss.precision", "kohakumoss.device"),
    "memory": ("kohakumoss.errors", "kohakumoss.model", "kohakumoss.precision", "kohakumoss.device",
               "kohakumoss.portable"),
    "quant": ("kohakumoss.errors", "kohakumoss.model", "kohakumoss.kernels", "kohakumoss.precision"),
    "precision": ("kohakumoss.device",),
}


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append(node.module)
    return out


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_layering(package):
    root = ROOT / "kohakumoss" / package
    allowed = (f"kohakumoss.{package}", *ALLOWED[package])
    bad = [(f.name, m) for f in sorted(root.rglob("*.py")) for m in _imports(f)
           if (m == "kohakumoss" or m.startswith("kohakumoss."))
           and not any(m == a or m.startswith(a + ".") for a in allowed)]
    assert not bad, bad


def test_a_runs_kernel_choices_are_kept_for_its_resume(tmp_path):
    """Choices measured at train time depend on timing: a run makes them once, keeps them in
    runs/<name>/kernels.json, and a resumed start reuses them; another plan makes them again."""
    from kohakumoss.training.build import run_kernels

    plan = EnginePlan(torch.device("cpu"), precision_policy("fp32", full=False))
    path = tmp_path / "run" / "kernels.json"
    draws = iter([{"situ": ["compile"]}, {"situ": ["reference"]}, {"situ": ["triton"]}])
    first = run_kernels(path, plan, "plan-a", lambda: next(draws))
    assert first == {"situ": ["compile"]} and path.is_file()
    assert run_kernels(path, plan, "plan-a", lambda: next(draws)) == first  # the resume
    assert run_kernels(path, plan, "plan-b", lambda: next(draws)) == {"situ": ["reference"]}
    path.write_text("{not json")
    assert run_kernels(path, plan, "plan-b", lambda: next(draws)) == {"situ": ["triton"]}


def test_a_full_finetune_refuses_resident_blocks():
    """Resident blocks keep a frozen base's weights on the device; a full finetune streams
    every block (its masters are the host update's), so the engines refuse the mix."""
    from kohakumoss.model import MOSSImageTransformer
    from kohakumoss.training.engines import EnginePlan, apply_placement

    model = MOSSImageTransformer(FLAVORS["tiny"])  # every weight trains
    plan = EnginePlan(torch.device("cpu"), precision_policy("bf16", full=True),
                      memory=MemoryEngines("block", stream_slots=2, optimizer="host", resident_blocks=1))
    with pytest.raises(ValueError, match="a full finetune streams every block"):
        apply_placement(model, None, plan, None)
