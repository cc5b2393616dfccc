"""`kmoss config`: write or update params.yaml for your card, weights and data."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.markup import escape

from stages.common import stage, wide_console

out = wide_console()


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
                                    help="Replace an existing params file (kept as <name>.bak)."),
         wizard: bool = typer.Option(False, "--wizard",
                                     help="Ask for each choice (weights, data, name, algorithm, "
                                          "card), then offer the memory catalog's fastest "
                                          "settings for the card. Plain `kmoss config` in a "
                                          "terminal asks for what the command line leaves out.")):
    """Write or update PARAMS for your card, weights and data, and say what was chosen and why.

    Every value is checked as the stages check it, and the memory estimator predicts the
    step's peak, before anything is written.
    """
    from kohakumoss.configlib import ConfigError
    from kohakumoss.setup.configure import configure

    terminal = sys.stdin.isatty()
    if wizard and not terminal:
        raise ConfigError("kmoss config --wizard asks in a terminal and stdin is not one: pass "
                          "--weights, --data, --name, --algo and --vram instead")
    if terminal and (wizard or (weights is None and data is None and recipe is None)):
        from kohakumoss.setup.wizard import run_wizard

        report = run_wizard(params, lambda q, d: typer.prompt(q, default=d, show_default=bool(d)),
                            lambda line: out.print(escape(line), highlight=False, soft_wrap=True),
                            given=dict(weights=weights, data=data, name=name, algo=algo, vram=vram),
                            force=force)
    else:
        report = configure(params, weights=weights, data=data, name=name, algo=algo, vram=vram,
                           recipe=recipe, tokenizer=tokenizer, force=force)
        for line in report.lines:
            out.print(escape(line), highlight=False, soft_wrap=True)
    if report.written:
        out.print(f"next: dvc repro (or dvc exp run) reads {escape(str(report.written))}",
                  highlight=False, soft_wrap=True)
