"""`kmoss check ...`: checks a user can run on their install."""

from __future__ import annotations

from pathlib import Path

import typer


from stages.common import stage, wide_console

out = wide_console()
BATCH_KEYS = ("img", "text", "sigma", "hw", "text_len")  # what every comparison of a set reads


def check_vector_set(folder: Path) -> None:
    """A vector set's folder, its batch file and one weights file exist and read, else an
    ``ArtifactError`` naming what is missing."""
    from safetensors import SafetensorError, safe_open

    from kohakumoss.artifacts import ArtifactError
    from kohakumoss.checks.parity import WEIGHT_FILES

    form = ("a reference vector set: a folder with batch.safetensors and "
            f"{' or '.join(WEIGHT_FILES.values())} (e.g. tests/data/vectors)")
    if not folder.is_dir():
        raise ArtifactError(f"{folder} {'is not a folder' if folder.exists() else 'does not exist'}"
                            f": expected {form}")
    batch = folder / "batch.safetensors"
    weights = [folder / f for f in WEIGHT_FILES.values() if (folder / f).is_file()]
    if not batch.is_file() or not weights:
        missing = (["batch.safetensors"] if not batch.is_file() else []) + (
            [] if weights else [" or ".join(WEIGHT_FILES.values())])
        raise ArtifactError(f"{folder} lacks {' and '.join(missing)}: expected {form}")
    for f in [batch, *weights]:
        try:
            with safe_open(str(f), "pt") as sf:
                keys = set(sf.keys())
        except SafetensorError as e:
            raise ArtifactError(f"{f} is not a readable safetensors file ({e}): expected {form}"
                                ) from None
        if f == batch and not set(BATCH_KEYS) <= keys:
            raise ArtifactError(f"{f} lacks the tensors {sorted(set(BATCH_KEYS) - keys)}: "
                                f"expected {form}")

app = typer.Typer(help="Checks of this install against reference numbers.", no_args_is_help=True)


@app.command("parity")
@stage
def parity(folder: Path = typer.Argument(..., help="A reference vector set (the format of the "
                                           "public vectors: weights_*.safetensors, batch.safetensors).")) -> None:
    """Run our model on CPU in float32 and float64 against a vector set (and the timestep
    distribution and inference schedules when it has them, computed with the knobs its
    config.json declares); one line per comparison with its relative error and PASS/FAIL.
    Exit code 1 on any FAIL."""
    from kohakumoss.checks.parity import all_comparisons

    check_vector_set(folder)
    failed = 0
    for c in all_comparisons(folder):
        out.print(c.line(), style=None if c.passed else "bold red", highlight=False)
        failed += not c.passed
    if failed:
        out.print(f"[bold red]{failed} comparison(s) failed[/]")
        raise typer.Exit(1)
    out.print("[green]all comparisons passed[/]")


@app.command("export")
@stage
def export(
    file: Path = typer.Argument(..., help="An exported ComfyUI adapter file."),
    source: Path = typer.Option(..., "--source", "-s", help="The checkpoint (or adapter file) it "
                                                            "was exported from."),
    strength: float = typer.Option(1.0, help="The strength (ComfyUI's slider) to compare at."),
    patch: str = typer.Option("fp32", "--patch-dtype",
                              help="ComfyUI's patching dtype: fp32 (its usual float32 copy) or "
                                   "fp16 / bf16 (low-VRAM loads patch in the compute dtype); "
                                   "half dtypes compare the patched weight."),
    model: str = typer.Option(None, "--model", "-m",
                              help="The base model: tiny or a model path. Given, no params file "
                                   "is read; default: the params file's model.transformer."),
    params: Path = typer.Option(Path("params.yaml"), "--params", "-p",
                                help="model.transformer names the base weights."),
    tolerance: float = typer.Option(None, help="Largest relative error per weight; default 5e-3 "
                                               "for a bf16/fp16 file, 1e-5 for fp32, and 8 unit "
                                               "roundoffs of the weight with --patch-dtype "
                                               "fp16/bf16."),
) -> None:
    """Load FILE the way ComfyUI interprets its keys and tensors (LoRA, LoHa, LoKr, OFT, BOFT,
    GLoRA, diff, DoRA semantics on the fused or split layout) and report, per targeted
    weight, the relative error at STRENGTH against the source adapter (kmoss's strength rule;
    ComfyUI's own for native OFT/BOFT blocks, with a note), and every key ComfyUI would not
    load. Exit code 1 on any failure."""
    from kohakumoss.export.check import check_export
    from kohakumoss.params import load_params

    p = None if model is not None or not params.is_file() else load_params(params)
    res = check_export(p, file, source, strength, model=model, patch=patch)
    tol = res.tolerance if tolerance is None else tolerance
    failed = 0
    for row in res.rows:
        ok = row.rel_error <= tol
        failed += not ok
        why = f"  ({row.note})" if row.note else ""
        out.print(f"{'PASS' if ok else 'FAIL'}  {row.name:<48} rel {row.rel_error:.3e}{why}",
                  highlight=False)
    for key in res.unloaded:
        out.print(f"FAIL  not loaded by ComfyUI: {key}", highlight=False)
    for note in res.notes:
        out.print(f"NOTE  {note}", highlight=False)
    what = "weights" if patch == "fp32" else f"{patch}-patched weights"
    if failed or res.unloaded:
        out.print(f"[bold red]{failed} weight(s) off (tolerance {tol:.1e}), {len(res.unloaded)} "
                  f"key(s) unloaded[/]")
        raise typer.Exit(1)
    out.print(f"[green]{len(res.rows)} {what} at strength {strength:g} match the source adapter "
              f"(tolerance {tol:.1e}); every key loads[/]")
