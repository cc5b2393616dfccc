"""Peak host memory of loading a large checkpoint (not a test).

    python bench/bench_load.py [--depth 8] [--workdir bench-out]

Writes a random MOSS-Image-width model (dim 3072, ffn 8192, text 4096, ``depth`` joint
blocks) as a bf16 ComfyUI file (fused qkv), then loads it in a fresh process with
``load_transformer(dtype=bfloat16)`` and reports the file size, the load time and the
process's peak resident memory above its baseline: loading builds on the meta device and
materialises tensor by tensor from a memory-mapped file, so the peak stays near one copy
of the weights (the tensors stay backed by the file's pages until written; the fp32-kept
modules and the split q/k/v of a fused file are copies).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from kohakumoss.model import DiTConfig, MOSSImageTransformer
from kohakumoss.formats.model_files import save_comfy

CHILD = """
import sys, time, torch, json
import kohakumoss.formats.model_files as ck
def hwm():  # peak resident set of this process, KiB (reset by exec, unlike ru_maxrss)
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
base = hwm()
t0 = time.perf_counter()
model, info = ck.load_transformer(sys.argv[1], dtype=torch.bfloat16)
dt = time.perf_counter() - t0
n = sum(p.numel() * p.element_size() for p in model.parameters())
after_load = hwm()
with torch.no_grad():  # read every weight once, as a move to the GPU would
    touched = sum(float(p.float().sum()) for p in model.parameters())
print(json.dumps({"load_s": dt, "baseline_mib": base / 1024, "peak_after_load_mib": after_load / 1024,
                  "peak_mib": hwm() / 1024, "model_bytes_mib": n / 2**20, "layout": info.layout}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--workdir", type=Path, default=Path("bench-out"))
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    cfg = DiTConfig(depth=a.depth, negative_skip_layers=())
    path = a.workdir / f"moss_depth{a.depth}_bf16.safetensors"
    if not path.exists():
        with torch.device("meta"):
            m = MOSSImageTransformer(cfg)
        m.to_empty(device="cpu")
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.02)
        save_comfy(m, path, cfg, dtype=torch.bfloat16)
        del m
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True,
                         check=True).stdout
    r = json.loads(out)
    r.update(params=cfg.num_params(), file_mib=path.stat().st_size / 2**20,
             peak_over_baseline_mib=r["peak_mib"] - r["baseline_mib"], date=time.strftime("%Y-%m-%d"))
    print(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
