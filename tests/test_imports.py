"""The package's import graph points one way: each unit (a subpackage or a top-level module of
``kohakumoss``) imports only units of lower layers, so there are no cycles, ``model/`` stays
single-device math that imports nothing above it, and a new package must be placed here on
purpose. Every import counts, including the lazy ones inside functions."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "kohakumoss"

# low -> high; a unit may import units of strictly lower layers only (docs/architecture.md)
LAYERS: list[set[str]] = [
    {"kohakumoss", "errors", "faults", "seeding", "device", "progress", "portable"},
    {"configlib", "artifacts", "precision", "images"},
    {"config", "tokenizer", "model"},
    {"diffusion", "optimizers"},  # the objective's ops (a contract the kernel registry serves
    # too); the optimizers' table (what each refuses, its state's size)
    {"kernels", "memory", "parallel"},
    {"quant", "experimental"},  # the quantized base in one room; opt-in backends (never imported)
    {"adapters"},  # LyCORIS on the block linears (an fp8 one's node: quant's slot widths)
    {"formats"},
    {"encoders", "data"},  # neither imports the other: tokenizer/ is below both
    {"cache"},
    {"checks"},
    {"params"},
    {"training"},
    {"export", "generate", "setup"},
]
LAYER = {unit: n for n, units in enumerate(LAYERS) for unit in units}
# what model/ may import: the model is math over explicit tensors (no engines, no formats)
MODEL_MAY_IMPORT = {"errors"}


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path, root: Path = ROOT) -> list[tuple[str, int]]:
    """(imported kohakumoss module, line) for every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    here = module_name(path, root).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((name, node.lineno))
    return sorted((n, line) for n, line in found if n == "kohakumoss" or n.startswith("kohakumoss."))


def edges() -> dict[tuple[str, str], list[str]]:
    out: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        src = unit_of(module_name(path))
        for target, line in imports_of(path):
            dst = unit_of(target)
            if dst != src:
                out[(src, dst)].append(f"{path.relative_to(ROOT)}:{line}")
    return out


def test_every_unit_has_a_layer():
    units = {unit_of(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert units - set(LAYER) == set(), "place the new unit in LAYERS (and docs/architecture.md)"


def test_imports_point_down():
    upward = [f"{src} -> {dst} ({', '.join(where)})" for (src, dst), where in sorted(edges().items())
              if LAYER.get(dst, -1) >= LAYER.get(src, -1)]
    assert upward == [], "imports that point up or sideways:\n" + "\n".join(upward)


def test_model_imports_nothing_above_it():
    above = {dst: where for (src, dst), where in edges().items()
             if src == "model" and dst not in MODEL_MAY_IMPORT}
    assert above == {}


def test_the_core_never_imports_the_experimental_room():
    """``kohakumoss/experimental/`` holds opt-in backends: no other unit and no stage imports
    it (the kernel registry loads one by name where ``kernels.backends`` names it,
    ``KernelRegistry.load_experimental``); only its own benches and tests do."""
    found = [f"{src} -> experimental ({', '.join(where)})" for (src, dst), where in edges().items()
             if dst == "experimental" and src != "experimental"]
    for folder in ("stages",):
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += [f"{path.relative_to(ROOT)}:{line}" for name, line in imports_of(path)
                      if unit_of(name) == "experimental"]
    assert found == []


def test_export_reads_checkpoints_without_the_trainer():
    """A checkpoint is a file format (``formats/checkpoint.py``, ``formats/trained.py``):
    ``export/`` and the sampler read one without importing ``training/``."""
    found = {f"{src} -> training ({', '.join(where)})" for (src, dst), where in edges().items()
             if src == "export" and dst == "training"}
    assert found == set()


def test_the_graph_has_no_cycles():
    graph: dict[str, set[str]] = defaultdict(set)
    for src, dst in edges():
        graph[src].add(dst)
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(trail + [node, nxt]))
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """The rules above cannot pass vacuously: an import inside a function and a relative
    import are both found, and an upward edge is reported."""
    pkg = tmp_path / "kohakumoss" / "model"
    pkg.mkdir(parents=True)
    (tmp_path / "kohakumoss" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    f = pkg / "bad.py"
    f.write_text("def load():\n    from kohakumoss.adapters import x\n\nfrom ..training import y\n")
    rel = imports_of(f, tmp_path)
    assert rel == [("kohakumoss.adapters", 2), ("kohakumoss.training", 4)]
    assert all(LAYER[unit_of(n)] > LAYER["model"] for n, _ in rel)

