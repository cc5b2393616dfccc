"""A run's metrics: rows persisted with its checkpoints, mirrored to DVCLive.

DVC deletes a stage's non-persisted outputs (``dvclive/metrics.json``, the plots, the
summary) before it runs the stage, and a killed run logged rows after its last checkpoint.
So the DVCLive files are never the record: the record is the list of rows saved inside
every checkpoint (``log.json``), and each start of the train stage rebuilds ``dvclive/``
from the resumed checkpoint's rows, then appends. A forced re-run of a finished run, a
resume and a no-op therefore all leave the same files: every logged step once, in order.

Preview images are kept under ``runs/<name>/previews/`` (outside DVC's outputs) and
re-logged to DVCLive on a rebuild, so the plots page keeps them too.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

from kohakumoss.artifacts import atomic_path

log = logging.getLogger(__name__)

PREFIX = "train/"
IMAGES = "previews/"  # DVCLive image names start with it; the kept files do not
STEP_OF_IMAGE = re.compile(r"step-(\d+)")
# what depends on the machine and the moment, not on the run: left out when two runs'
# metrics are compared (tests, `summary.json`)
TIMING = ("samples_per_s", "memory_gib")


class RunLog:
    """Metric rows (``{"step": n, name: value, ...}``) and preview images of one run.

    ``rows`` are the rows the run already has (from the checkpoint it resumes); the
    DVCLive folder is rebuilt from them and from the kept previews up to their last step.
    """

    def __init__(self, dvclive_dir: str | Path, previews_dir: str | Path,
                 rows: list[dict[str, Any]], upto: int):
        from dvclive import Live

        self.dir, self.previews = Path(dvclive_dir), Path(previews_dir)
        self.rows = [dict(r) for r in rows if int(r["step"]) <= upto]
        _drop_previews_after(self.previews, upto)
        # a fresh Live removes what DVCLive wrote before (metrics.json, plots/): rebuilt below
        self.live = Live(dir=str(self.dir), resume=False, save_dvc_exp=False, dvcyaml=False,
                         report=None)
        for row in self.rows:
            self._write(row)
        for image in sorted(self.previews.rglob("*.png")) if self.previews.is_dir() else []:
            self.live.log_image(IMAGES + image.relative_to(self.previews).as_posix(), image)

    def _write(self, row: dict[str, Any]) -> None:
        self.live.step = int(row["step"])
        for name, value in row.items():
            if name != "step":  # a name with its own prefix (val/) keeps it
                self.live.log_metric(name if "/" in name else PREFIX + name, float(value))
        self.live.next_step()

    def log(self, step: int, **values: float) -> None:
        row = {"step": int(step), **{k: float(v) for k, v in values.items()}}
        self.rows.append(row)
        self._write(row)

    def image(self, name: str, image) -> None:
        """Keep ``image`` (named ``previews/...``) in the previews folder, log it to DVCLive."""
        path = self.previews / name.removeprefix(IMAGES)
        with atomic_path(path) as tmp:
            image.save(tmp, format="PNG")
        self.live.log_image(name, path)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (``log.json``)."""
        return {"metrics": list(self.rows)}

    def close(self) -> None:
        self.live.end()


def rows_of(state: dict[str, Any] | None) -> list[dict[str, Any]]:
    return list((state or {}).get("metrics", []))


def comparable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows without the timing columns: what two runs of the same params must share."""
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def _drop_previews_after(previews: Path, step: int) -> None:
    """Previews of steps after ``step`` were made by a run that died before its next
    checkpoint; the resumed run makes them again."""
    if not previews.is_dir():
        return
    for folder in previews.rglob("step-*"):
        m = STEP_OF_IMAGE.fullmatch(folder.name)
        if m and folder.is_dir() and int(m.group(1)) > step:
            shutil.rmtree(folder, ignore_errors=True)
