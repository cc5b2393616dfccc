"""`kmoss plan`: plan every batch of the run from the catalogs."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from stages.common import PARAMS_OPTION, console, stage


@stage
def main(
    params: Path = PARAMS_OPTION,
    catalog: Path = typer.Option(Path("artifacts/catalog"), help="The scan's catalog directory."),
    out: Path = typer.Option(Path("artifacts/plan"), help="Plan directory."),
) -> None:
    """Plan the whole run: every batch of steps x grad_accum x world_size, with its samples,
    target sizes, crop boxes, flips, rendered captions and text-drop decisions.

    The plan is a pure function of (catalogs, seed, planning knobs): the same inputs give a
    byte-identical plan.parquet. Inspect it with pandas/pyarrow or read summary.json.
    """
    from kohakumoss.params import load_params
    from kohakumoss.data.planfile import make_plan

    p = load_params(params)
    manifest, s = make_plan(p, catalog, out)
    table = Table(title=f"plan {manifest.content_hash[:12]} in {out}", show_header=False)
    rows = [
        ("batches / samples", f"{s['batches']} / {s['samples']}"),
        ("steps x grad_accum x world", f"{s['steps']} x {s['grad_accum']} x {s['world_size']}"),
        ("epochs planned", str(s["epochs_planned"])),
        ("mean samples per batch", f"{s['mean_samples_per_batch']:.2f}"),
        ("joint tokens per batch (p50 / max)",
         f"{s['joint_tokens_per_batch'].get('p50', 0):.0f} / {s['max_joint_tokens']} "
         f"(budget {s['max_tokens']}, {s['token_budget']})"),
        ("budget fill", f"{s['budget_fill']:.1%}"),
        ("over-long dropped / fitted", f"{sum(s['overlong_dropped'])} / {sum(s['overlong_fitted'])}"),
        ("text dropped", str(s["text_dropped"])),
        ("distinct target sizes", str(s["distinct_sizes"])),
        ("top sizes (h x w: samples)",
         ", ".join(f"{t['h']}x{t['w']}: {t['samples']}" for t in s["top_sizes"][:4])),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)


if __name__ == "__main__":
    typer.run(main)
