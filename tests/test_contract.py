"""The engine contract (``kohakumoss/model/engines.py``, ``docs/engines.md#the-contract``):
engines act on the DiT only through its registry, and the model asks the registry instead
of inspecting modules.

- No code outside ``model/`` assigns ``forward`` (or, through ``setattr``, anything) on a
  model or a block, nor a new attribute on one (statically, over the library, the stages
  and the benches; and at run time, on a model with every engine applied).
- ``model/`` never reads a module's ``__dict__``, its hook dicts or its compiled state.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from conftest import ROOT

MODEL = ROOT / "kohakumoss" / "model"
# code that builds and runs a model other than the DiT (the text encoder: transformers' Qwen
# model, whose attributes are its own), so a ``model`` name there is not the DiT
FOREIGN_MODELS = {ROOT / "kohakumoss" / "encoders"}
# files that assign the forward of a module that is neither a model nor a block, and why
LINEAR_FORWARDS = {
    ROOT / "kohakumoss" / "adapters" / "runtime.py": "the LyCORIS module's own forward (``install``)",
    ROOT / "kohakumoss" / "memory" / "replay.py": "a frozen tail linear, within one recomputation, "
                                                 "claimed in the registry meanwhile",
}
MODEL_NAMES = {"model", "block", "dit", "transformer"}  # how code names the DiT and its blocks
INSPECTED = {"__dict__", "_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
             "_backward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
             "_compiled_call_impl", "_global_forward_hooks", "_global_forward_pre_hooks",
             "_global_backward_hooks", "_global_backward_pre_hooks"}


def _declared() -> set[str]:
    """Every attribute the DiT and its blocks have once built (what ``model/`` declares)."""
    from kohakumoss.model.build import tiny_transformer

    model = tiny_transformer()
    names = set(vars(model)) | {n for c in type(model).__mro__ for n in vars(c)}
    for block in [*model.layers, *model.text_embedder.blocks]:
        names |= set(vars(block)) | {n for c in type(block).__mro__ for n in vars(c)}
    return names - {"forward"}


def _owner(node: ast.expr) -> str | None:
    """``model`` for ``model.x``, ``self.model.x`` and ``c.model.x``; else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and node.attr in MODEL_NAMES:
        return node.attr
    return None


def patches(path: Path, declared: set[str]) -> list[str]:
    """``file:line what`` for each patch of a model or a block found in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    foreign = any(d in path.parents for d in FOREIGN_MODELS)
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if not isinstance(sub, ast.Attribute):
                    continue
                if sub.attr == "forward" and path not in LINEAR_FORWARDS:
                    found.append(f"{path.relative_to(ROOT)}:{sub.lineno} assigns .forward")
                elif not foreign and _owner(sub.value) in MODEL_NAMES and sub.attr not in declared:
                    found.append(f"{path.relative_to(ROOT)}:{sub.lineno} sets a new attribute "
                                 f"{_owner(sub.value)}.{sub.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and node.args:
            name = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else None
            if name == "forward" or (not foreign and _owner(node.args[0]) in MODEL_NAMES):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} setattr on "
                             f"{ast.unparse(node.args[0])}")
    return found


def inspections(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return [f"{path.relative_to(ROOT)}:{n.lineno} reads .{n.attr}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in INSPECTED]


def _sources() -> list[Path]:
    return sorted(p for d in ("kohakumoss", "stages", "bench") for p in (ROOT / d).rglob("*.py")
                  if MODEL not in p.parents)


def test_no_engine_patches_a_model_or_a_block():
    declared = _declared()
    found = [f for p in _sources() for f in patches(p, declared)]
    assert found == [], "engines act through model.engines (model/engines.py):\n" + "\n".join(found)


def test_the_model_asks_the_registry_instead_of_inspecting_modules():
    found = [f for p in sorted(MODEL.rglob("*.py")) for f in inspections(p)]
    assert found == [], "\n".join(found)


def test_the_checkers_find_what_they_forbid(tmp_path):
    """Neither check can pass vacuously: each finds a planted violation."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f(model, block, lin):\n"
                   "    model.forward = lambda *a: a\n"
                   "    block.kmoss_state = 1\n"
                   "    setattr(block, 'attention', None)\n"
                   "    model.ops = None\n"  # declared by the model: allowed
                   "    lin.weight_thing = 2\n"  # not a model or a block: allowed
                   "    return model.__dict__, block._compiled_call_impl\n")
    moved = ROOT / "kohakumoss" / "_planted_check.py"
    try:
        moved.write_text(bad.read_text())
        found = patches(moved, _declared())
        assert [f.split(" ", 1)[1] for f in found] == [
            "assigns .forward", "sets a new attribute block.kmoss_state", "setattr on block"], found
        assert len(inspections(moved)) == 2
    finally:
        moved.unlink()


def test_every_engine_applied_leaves_the_model_and_its_blocks_as_built():
    """At run time: a tiny model with adapters, recomputation, offloaded sub-block
    checkpointing, rebuilt outputs and weight streaming, trained a step, has the instance
    attributes a fresh model has, on itself and on every block, and no forward of its own;
    the registry names every engine, and the blocks run whole (none chained)."""
    from kohakumoss.adapters import apply_adapters
    from kohakumoss.config import AdapterConfig
    from kohakumoss.memory import apply_recompute, repeated_blocks
    from kohakumoss.memory.offload import apply_activation_offload
    from kohakumoss.memory.rebuild import apply_rebuild
    from kohakumoss.memory.streaming import apply_weight_streaming
    from kohakumoss.model import build_layout
    from kohakumoss.model.build import tiny_transformer

    fresh, model = tiny_transformer(), tiny_transformer()
    apply_recompute(model)
    apply_activation_offload(model, "cpu", halves=True)
    apply_rebuild(model)
    aset = apply_adapters(model, AdapterConfig(algo="lora", dim=2, alpha=2.0), seed=0)
    apply_weight_streaming(model, "cpu", 2)
    names = model.engines.names()
    assert names[:3] == ["recompute", "activation offload", "rebuild"] and names[4] == "weight streaming"
    assert names[3].startswith("adapter ") and len(names) == 5
    assert model.chained_blocks() == [False] * len(model.layers)
    c = model.config
    layout = build_layout([(2, 2)], [3])
    g = torch.Generator().manual_seed(0)
    v = model(torch.randn(layout.n_img, c.latent_channels, generator=g),
              torch.randn(layout.n_txt, c.text_dim, generator=g), torch.tensor([0.5]), layout)
    v.square().mean().backward()
    assert all(p.grad is not None for p in aset.trainable_parameters())
    assert set(vars(model)) == set(vars(fresh))
    for (path, block), (_, same) in zip(repeated_blocks(model), repeated_blocks(fresh)):
        assert set(vars(block)) == set(vars(same)), path
        assert "forward" not in vars(block) and model.engines.wrapped_parts(block) == ("attention", "mlp")
    aset.remove()
    assert not any(n.startswith("adapter") for n in model.engines.names())


def _function(path: Path, cls: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _branches_on(fn: ast.FunctionDef, words: set[str]) -> list[str]:
    """The ``if`` tests of ``fn`` (statements and expressions) that name any of ``words``."""
    tests = [n.test for n in ast.walk(fn) if isinstance(n, (ast.If, ast.IfExp, ast.While))]
    return [ast.unparse(t) for t in tests
            if {w for n in ast.walk(t) for w in (getattr(n, "id", None), getattr(n, "attr", None))} & words]


def test_the_forward_and_the_step_are_short_and_do_not_branch_on_engines_or_steppers():
    """``MOSSImageTransformer.forward`` and ``Trainer.step`` each stay under 30 lines;
    neither has a branch on an engine or on the stepping kind (those live behind
    ``model.engines`` and ``Trainer.stepper``)."""
    forward = _function(ROOT / "kohakumoss" / "model" / "dit.py", "MOSSImageTransformer", "forward")
    step = _function(ROOT / "kohakumoss" / "training" / "trainer.py", "Trainer", "step")
    for fn in (forward, step):
        assert fn.end_lineno - fn.lineno + 1 < 30, (fn.name, fn.end_lineno - fn.lineno + 1)
    engines = {"engines", "ring", "weight_ring", "offloader", "rebuilder", "chain", "hooked",
               "skip", "skip_layers", "skip_samples", "text_cache"}
    steppers = {"stepper", "fused", "streamed", "update", "host", "sharded", "scaler", "kind", "dist"}
    assert [ast.unparse(n) for n in ast.walk(forward) if isinstance(n, (ast.If, ast.IfExp))] == \
        ["self.refine_text(text_NT, layout) if refined is None else refined"]
    assert _branches_on(forward, engines) == []
    assert _branches_on(step, steppers | engines) == []


def test_the_performance_page_is_a_page():
    """``docs/performance.md`` holds the current figures as tables (under 400 lines); the
    history is ``docs/history.md``'s."""
    text = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) < 400
    assert "pass" not in " ".join(line for line in text.splitlines() if line.startswith("#")).lower()


QUANT = ROOT / "kohakumoss" / "quant"


def knob_reads(path: Path) -> list[str]:
    """Where ``path`` decodes ``precision.fp8_compute`` itself: reads the knob off a params
    ``precision`` section, or compares an ``fp8_compute`` with one of the knob's words."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr == "fp8_compute" and (
                (isinstance(n.value, ast.Name) and n.value.id == "precision")
                or (isinstance(n.value, ast.Attribute) and n.value.attr == "precision")):
            found.append(f"{path.relative_to(ROOT)}:{n.lineno} reads {ast.unparse(n)}")
        elif isinstance(n, ast.Compare):
            sides = [n.left, *n.comparators]
            named = any("fp8_compute" in ast.unparse(s) for s in sides)
            words = {c.value for s in sides for c in ast.walk(s) if isinstance(c, ast.Constant)}
            if named and words & {"off", "on", "full", "fast"}:
                found.append(f"{path.relative_to(ROOT)}:{n.lineno} decodes {ast.unparse(n)}")
    return found


def test_only_quant_decodes_the_fp8_compute_knob(tmp_path):
    """``kohakumoss/quant/plan.py`` is the one decoder of ``precision.fp8_compute``: the rest
    reads its ``QuantPlan`` (the checker finds a planted read and a planted comparison)."""
    found = [f for p in _sources() if QUANT not in p.parents for f in knob_reads(p)]
    assert found == [], "decode precision.fp8_compute with kohakumoss.quant.quant_plan:\n" + "\n".join(found)
    planted = tmp_path / "planted.py"
    planted.write_text("def f(p, knob):\n    a = p.precision.fp8_compute\n"
                       "    return knob.fp8_compute in ('full', 'fast')\n")
    moved = ROOT / "kohakumoss" / "_planted_knob.py"
    try:
        moved.write_text(planted.read_text())
        assert len(knob_reads(moved)) == 2
    finally:
        moved.unlink()
