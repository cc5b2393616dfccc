"""`kmoss profiles`: the memory catalog, every valid combination of the memory engines with
its predicted peak, fastest first (docs/memory.md#the-catalog)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from stages.common import stage, wide_console


def catalog_table(rows, title: str) -> Table:
    from kohakumoss.training.estimate import size

    t = Table(title=title)
    for col in ("#", "profile", "checkpointing", "slots", "optimizer", "offload", "rebuild",
                "recompute", "base", "peak", "host RAM", "x speed"):
        t.add_column(col, justify="right" if col in ("#", "slots", "peak", "host RAM", "x speed") else "left")
    for i, r in enumerate(rows, 1):
        e = r.engines
        mode = e.checkpointing + (f" {e.checkpoint_blocks}" if e.checkpointing == "partial" else "")
        t.add_row(str(i), r.name or "-", mode, str(e.stream_slots), e.optimizer,
                  "yes" if e.offload else "-", "yes" if e.rebuild else "-",
                  "on" if e.recompute else "off", r.base, size(r.peak), size(r.host),
                  f"{r.speed:.3f}{'' if r.measured else '*'}")
    return t


@stage
def main(params: Path = typer.Option(Path("params.yaml"), "--params", "-p",
                                     help="The run whose model, adapter and token budget are sized."),
         vram: float = typer.Option(None, "--vram", help="Only what fits a card of this many GiB."),
         ram: float = typer.Option(None, "--ram", help="Only what fits this many GiB of host RAM."),
         plan: Path = typer.Option(Path("artifacts/plan"), help="The plan whose largest "
                                   "micro-batch is estimated (if it is there; else a full "
                                   "batching.max_tokens micro-batch)."),
         top: int = typer.Option(0, help="Show only the first N rows (0: all).")) -> None:
    """Every valid combination of the memory engines (checkpointing mode and blocks, weight
    slots, optimizer placement, activation offload, rebuild, recompute, quantized base) for
    the params' model, adapter and token budget: the estimator's device peak and host
    memory, and samples/s against `speed` (measured for the named profiles, else the cost
    model: marked *), fastest first. `--vram 8 --ram 32` keeps what fits."""
    from kohakumoss.params import load_params
    from kohakumoss.training.catalog import catalog, fitting, typical_batch

    p = load_params(params)
    batch, what = typical_batch(p, plan)
    rows = catalog(p, batch)
    shown = fitting(rows, vram, ram)
    limits = ", ".join(x for x in (f"{vram:g} GiB card" if vram else "", f"{ram:g} GiB RAM" if ram else "") if x)
    title = (f"{len(shown)} of {len(rows)} valid combinations"
             + (f" fit a {limits}" if limits else "") + f", for {what}")
    out = wide_console()
    out.print(catalog_table(shown[:top] if top else shown, title))
    out.print("* the cost model of memory/profiles.py; the named profiles' figures are measured "
              "(docs/performance.md#memory-profiles). Set one with profile: manual and its "
              "memory: knobs, or name the profile.")
