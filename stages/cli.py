"""The `kmoss` command: every pipeline stage as a subcommand."""

from __future__ import annotations

import typer

from stages import (cache_latents, cache_text, check, config, doctor, export, grid, plan, sample, scan,
                    train, tune_kernels)

app = typer.Typer(
    name="kmoss",
    help="kohakumoss: finetune MOSS-Image as a DVC pipeline (scan -> plan -> ...). "
         "Every stage reads params.yaml; `dvc repro` runs them in order.",
    no_args_is_help=True,
    add_completion=False,
)
app.command("scan")(scan.main)
app.command("plan")(plan.main)
app.command("cache_text")(cache_text.main)
app.command("cache_latents")(cache_latents.main)
app.command("tune_kernels")(tune_kernels.main)
app.command("train")(train.main)
app.command("sample")(sample.main)
app.command("grid")(grid.main)
app.add_typer(check.app, name="check")
app.command("doctor")(doctor.main)
app.command("config")(config.main)
app.add_typer(export.app, name="export")


if __name__ == "__main__":
    app()
