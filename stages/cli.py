"""The `kmoss` command: every pipeline stage as a subcommand."""

from __future__ import annotations

import inspect
import re

import typer

from stages import (cache_latents, cache_text, check, config, doctor, export, grid, plan, profiles,
                    sample, scan, train, tune_kernels)

app = typer.Typer(
    name="kmoss",
    help="kohakumoss: finetune MOSS-Image as a DVC pipeline (scan -> plan -> cache_text -> "
         "cache_latents -> tune_kernels -> train -> export). Every stage reads params.yaml; "
         "`dvc repro` runs them in order; `kmoss config` writes params.yaml for your card, "
         "weights and data.",
    no_args_is_help=True,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        import importlib.metadata as md
        import platform

        import torch

        typer.echo(f"kmoss {md.version('kohakumoss')} (torch {torch.__version__}, "
                   f"python {platform.python_version()})")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    """kohakumoss: finetune MOSS-Image as a DVC pipeline."""


app.command("config")(config.main)
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
app.command("profiles")(profiles.main)
app.add_typer(export.app, name="export")


def reflow(text: str) -> str:
    """A docstring as paragraphs of one line each: the help renderer wraps them to the
    terminal, instead of keeping the source's line breaks mid-sentence."""
    paragraphs = re.split(r"\n\s*\n", inspect.cleandoc(text))
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


def _reflow_all(group: typer.Typer) -> None:
    for command in group.registered_commands:
        doc = command.help or (command.callback.__doc__ if command.callback else None)
        if doc:
            command.help = reflow(doc)
    for sub in group.registered_groups:
        if sub.typer_instance.info.help:
            sub.typer_instance.info.help = reflow(sub.typer_instance.info.help)
        _reflow_all(sub.typer_instance)


_reflow_all(app)

if __name__ == "__main__":
    app()
