"""Metrics through DVCLive, so `dvc exp show` and `dvc plots` work, resumable with a run.

On resume, rows a killed run logged after its last checkpoint are dropped before logging
continues, so each step appears once in the plots.
"""

from __future__ import annotations

import csv
from pathlib import Path


class Metrics:
    def __init__(self, directory: Path, resume: bool, start_step: int):
        from dvclive import Live

        self.dir = Path(directory)
        if resume:
            _truncate_plots(self.dir / "plots" / "metrics", start_step)
        self.live = Live(dir=str(self.dir), resume=resume, save_dvc_exp=False, dvcyaml=False)

    def log(self, step: int, **values: float) -> None:
        self.live.step = step
        for name, value in values.items():
            self.live.log_metric(f"train/{name}", float(value))
        self.live.next_step()

    def image(self, name: str, image) -> None:
        self.live.log_image(name, image)

    def close(self) -> None:
        self.live.end()


def _truncate_plots(folder: Path, last_step: int) -> None:
    for tsv in folder.rglob("*.tsv"):
        with open(tsv, newline="") as f:
            rows = list(csv.reader(f, delimiter="\t"))
        if not rows:
            continue
        head, body = rows[0], rows[1:]
        col = head.index("step") if "step" in head else None
        if col is None:
            continue
        kept = [r for r in body if int(float(r[col])) <= last_step]
        with open(tsv, "w", newline="") as f:
            csv.writer(f, delimiter="\t").writerows([head, *kept])
