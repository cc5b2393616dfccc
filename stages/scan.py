"""`kmoss scan`: bring the per-source catalogs of params.yaml's datasets up to date."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from stages.common import PARAMS_OPTION, console, stage


@stage
def main(
    params: Path = PARAMS_OPTION,
    out: Path = typer.Option(Path("artifacts/catalog"), help="Catalog directory (persisted)."),
    report: Path = typer.Option(Path("artifacts/scan_report.json"),
                                help="Scan report: rejected images and what this run probed."),
) -> None:
    """Scan every dataset of `data.datasets` into an incremental Parquet catalog.

    Only new and changed files (by size and mtime) are probed: the header, then the image
    data once (data.verify_images). Unreadable, truncated or oversized images, broken links
    and unreadable sidecars are listed in the report with the reason and skipped; capped
    captions are reported as warnings.
    """
    from kohakumoss.params import load_params
    from kohakumoss.data.scan import scan

    p = load_params(params)
    manifest, stats = scan(p, out, report)
    table = Table(title=f"catalogs in {out}")
    for col in ("dataset", "source", "items", "probed", "cached", "removed", "live", "rejected",
                "warnings", "seconds"):
        table.add_column(col, justify="right" if col not in ("source",) else "left")
    for i, (entry, s) in enumerate(zip(p.data.datasets, stats)):
        table.add_row(str(i), entry.source, str(s.items), str(s.probed), str(s.cached),
                      str(s.removed), str(s.live), str(len(s.rejected)), str(len(s.warnings)),
                      f"{s.seconds:.2f}")
    console.print(table)
    for s in stats:
        for r in s.rejected[:20]:
            console.print(f"[yellow]skipped[/] {r['locator']}: {r['error']}", highlight=False)
    console.print(f"catalog {manifest.content_hash[:12]} (report: {report})")


if __name__ == "__main__":
    typer.run(main)
