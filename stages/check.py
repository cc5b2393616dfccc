"""`kmoss check ...`: checks a user can run on their install."""

from __future__ import annotations

from pathlib import Path

import typer

from rich.console import Console

from stages.common import stage

out = Console()
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
    params: Path = typer.Option(Path("params.yaml"), "--params", "-p",
                                help="model.transformer names the base weights."),
    tolerance: float = typer.Option(1e-2, help="Largest relative error per weight (1e-2 suits "
                                               "bf16 files; use 1e-5 for fp32 exports)."),
) -> None:
    """Load FILE the way ComfyUI interprets its keys and tensors (LoRA, LoHa, LoKr, OFT, BOFT,
    GLoRA, diff, DoRA semantics on the fused or split layout) and report, per targeted
    weight, the relative error against the source adapter's own delta, and every key
    ComfyUI would not load. Exit code 1 on any failure."""
    from kohakumoss.params import load_params
    from kohakumoss.export.check import check_export

    rows, unloaded = check_export(load_params(params), file, source)
    failed = 0
    for row in rows:
        ok = row.rel_error <= tolerance
        failed += not ok
        out.print(f"{'PASS' if ok else 'FAIL'}  {row.name:<48} rel {row.rel_error:.3e}", highlight=False)
    for key in unloaded:
        out.print(f"FAIL  not loaded by ComfyUI: {key}", highlight=False)
    if failed or unloaded:
        out.print(f"[bold red]{failed} weight(s) off, {len(unloaded)} key(s) unloaded[/]")
        raise typer.Exit(1)
    out.print(f"[green]{len(rows)} weights match the source adapter; every key loads[/]")
