"""Benchmark the data half of the pipeline on this machine (not a test).

    python bench/bench_data.py [--images 10000] [--rows 100000] [--workdir bench-out]

1. scan: 10,000 generated JPEGs (varied sizes, tag sidecars) in a kohya layout, cold;
   then a re-scan with nothing changed; then a re-scan after touching 100 files.
2. plan: a synthetic catalog of 100,000 rows (sizes drawn like a real photo set, tag
   captions), planned for one full epoch (greedy tokens, bucket mode, 1 MP, 16k budget).

Prints one JSON object; the figures go into docs/performance.md with hardware and commit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
from PIL import Image

from kohakumoss.params import parse_params
from kohakumoss.data.catalog import write_rows_catalog
from kohakumoss.data.rows import Row


def make_images(root: Path, n: int) -> None:
    rng = np.random.default_rng(0)
    sizes = [(96, 64), (64, 96), (80, 80), (128, 48), (48, 128), (112, 84)]
    base = {s: Image.fromarray(rng.integers(0, 256, (s[1], s[0], 3), dtype=np.uint8)) for s in sizes}
    for i in range(n):
        folder = root / f"{1 + i % 3}_concept{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        base[sizes[i % len(sizes)]].save(folder / f"{i:06d}.jpg", quality=80)
        (folder / f"{i:06d}.txt").write_text(f"tag{i % 97}, tag{i % 13}, concept{i % 10}, scene")


def params(datasets, **over):
    raw = {"data": {"datasets": datasets, "scan_workers": os.cpu_count() or 2},
           "resolution": {"mode": "bucket", "target_area": 1024 * 1024},
           "batching": {"mode": "tokens", "max_tokens": 16384, "overlong": "drop"},
           "train": {"steps": 1}}
    for k, v in over.items():
        raw.setdefault(k, {}).update(v)
    return parse_params(raw, "bench")


def bench_scan(work: Path, n: int) -> dict:
    from kohakumoss.data.scan import scan

    data = work / "images"
    if not data.exists():
        make_images(data, n)
    out = work / "catalog"
    shutil.rmtree(out, ignore_errors=True)
    p = params([{"source": "kohya", "path": str(data)}])
    t0 = time.perf_counter()
    _, s1 = scan(p, out)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, s2 = scan(p, out)
    warm = time.perf_counter() - t0
    files = sorted(data.rglob("*.jpg"))[:100]
    for f in files:
        st = f.stat()
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    t0 = time.perf_counter()
    _, s3 = scan(p, out)
    touched = time.perf_counter() - t0
    assert s1[0].probed == n and s2[0].probed == 0 and s3[0].probed == 100
    return {"images": n, "scan_cold_s": round(cold, 2), "rescan_unchanged_s": round(warm, 2),
            "rescan_100_changed_s": round(touched, 2),
            "images_per_s_cold": round(n / cold, 1)}


def bench_plan(work: Path, n: int) -> dict:
    from kohakumoss.data.planfile import make_plan
    from kohakumoss.data.scan import scan

    rng = np.random.default_rng(1)
    shard = work / "shards"
    (shard / "shards").mkdir(parents=True, exist_ok=True)
    w = rng.choice([1024, 1216, 832, 1920, 1080, 2048, 768, 3000], n)
    h = rng.choice([1024, 832, 1216, 1080, 1920, 1536, 512, 2000], n)
    rows = [Row(locator=f"0:{i}", w=int(w[i]), h=int(h[i]), group="g",
                tags=[f"tag{(i * 7 + k) % 500}" for k in range(int(rng.integers(5, 25)))],
                extra={"hash": f"{i:032x}"}) for i in range(n)]
    write_rows_catalog(shard / "catalog.parquet", rows)
    p = params([{"source": "moss_shard", "path": str(shard)}])
    scan(p, work / "catalog-plan")
    # one full epoch: count the batches of epoch 0 first, then plan exactly that many steps
    t0 = time.perf_counter()
    m, s = make_plan(p, work / "catalog-plan", work / "plan")
    t_one = time.perf_counter() - t0
    from kohakumoss.data.catalogset import load_catalogs
    from kohakumoss.data.plan import Planner

    epoch_batches = len(Planner(p, load_catalogs(work / "catalog-plan", p.data.datasets)).plan_epoch(0).batches)
    p = params([{"source": "moss_shard", "path": str(shard)}], train={"steps": epoch_batches})
    t0 = time.perf_counter()
    m, s = make_plan(p, work / "catalog-plan", work / "plan")
    t_epoch = time.perf_counter() - t0
    return {"rows": n, "epoch_batches": epoch_batches, "samples": s["samples"],
            "plan_one_step_s": round(t_one, 2), "plan_full_epoch_s": round(t_epoch, 2),
            "samples_per_s": round(s["samples"] / t_epoch, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=10_000)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--workdir", type=Path, default=Path("bench-out"))
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "cpus": os.cpu_count(),
              "machine": platform.processor() or platform.machine(),
              "scan": bench_scan(a.workdir, a.images), "plan": bench_plan(a.workdir, a.rows)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
