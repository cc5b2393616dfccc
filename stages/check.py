"""`kmoss check ...`: checks a user can run on their install."""

from __future__ import annotations

from pathlib import Path

import typer

from rich.console import Console

from stages.common import stage

out = Console()

app = typer.Typer(help="Checks of this install against reference numbers.", no_args_is_help=True)


@app.command("parity")
@stage
def parity(folder: Path = typer.Argument(..., help="A reference vector set (the format of the "
                                           "public vectors: weights_*.safetensors, batch.safetensors).")) -> None:
    """Run our model on CPU in float32 and float64 against a vector set (and the timestep
    sampler and inference schedules when it has them); one line per comparison with its
    relative error and PASS/FAIL. Exit code 1 on any FAIL."""
    from kohakumoss.model.parity import all_comparisons

    failed = 0
    for c in all_comparisons(folder):
        out.print(c.line(), style=None if c.passed else "bold red", highlight=False)
        failed += not c.passed
    if failed:
        out.print(f"[bold red]{failed} comparison(s) failed[/]")
        raise typer.Exit(1)
    out.print("[green]all comparisons passed[/]")
