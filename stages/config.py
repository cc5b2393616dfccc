"""`kmoss config`: write or update params.yaml for your card, weights and data."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.markup import escape

from stages.common import stage, wide_console

out = wide_console()


def _ask(what: str, current: str | None) -> str | None:
    """In a terminal, ask for a value the command line left out (Enter keeps the file's)."""
    if current is not None or not sys.stdin.isatty():
        return current
    answer = typer.prompt(f"{what} (Enter: keep params.yaml's)", default="", show_default=False)
    return answer or None


@stage
def main(params: Path = typer.Option(Path("params.yaml"), "--params", "-p",
                                     help="The params file to write or update."),
         weights: str = typer.Option(None, "--weights", "-w",
                                     help="'tiny', a MOSS-Image pipeline folder, or a ComfyUI "
                                          "models/ folder (files found by their keys, int8/fp8 "
                                          "ones too)."),
         data: str = typer.Option(None, "--data", "-d",
                                  help="Your images: a folder, kohya folders, tar shards or a glob, "
                                       "a parquet or jsonl file (the source kind is detected)."),
         name: str = typer.Option(None, "--name", "-n", help="The run's name (runs/<name>/)."),
         algo: str = typer.Option(None, "--algo",
                                  help="lora locon loha lokr dora oft boft glora ia3 dylora tlora, "
                                       "or full."),
         vram: str = typer.Option(None, "--vram",
                                  help="Size the run for a card: auto (read it), 6, 8, 12, 16, 24, "
                                       "or 24-full (a full finetune): profile, token budget, "
                                       "resolution and encoder placement (docs/config.md)."),
         recipe: str = typer.Option(None, "--from",
                                    help="Start from a recipe: a name in recipes/ (lora-1mp, "
                                         "full-1mp) or a .yaml path; real weights default to "
                                         "lora-1mp (full-1mp for a full finetune)."),
         tokenizer: str = typer.Option(None, "--tokenizer",
                                       help="The tokenizer folder of a single-file text encoder."),
         force: bool = typer.Option(False, "--force",
                                    help="Replace an existing params file (kept as <name>.bak).")):
    """Write or update PARAMS for your card, weights and data, and say what was chosen and why.

    Every value is checked as the stages check it, and the memory estimator predicts the
    step's peak, before anything is written.
    """
    from kohakumoss.setup.configure import configure

    weights = _ask("Weights: tiny, a pipeline folder or a ComfyUI models/ folder", weights)
    data = _ask("Dataset path", data)
    report = configure(params, weights=weights, data=data, name=name, algo=algo, vram=vram,
                       recipe=recipe, tokenizer=tokenizer, force=force)
    for line in report.lines:
        out.print(escape(line), highlight=False, soft_wrap=True)
    if report.written:
        out.print(f"next: dvc repro (or dvc exp run) reads {escape(str(report.written))}",
                  highlight=False, soft_wrap=True)
