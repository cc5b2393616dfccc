"""The benchmarks' one way to report: the results as JSON on stdout, and in ``$OUT/<name>.json``
when ``$OUT`` is set (the device machine sends that folder back); and their one CUDA-event
timer, ``cuda_ms``."""

from __future__ import annotations

import json
import os


def report(res: dict, name: str) -> None:
    text = json.dumps(res, indent=2)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"{name}.json"), "w") as f:
            f.write(text)


def cuda_ms(fn, reps: int = 1, iters: int = 15) -> float:
    """Milliseconds per call of ``fn`` on the current CUDA stream: the median over ``iters``
    of CUDA events around ``reps`` back-to-back calls (reps 1: single calls), after 3 warm-up
    calls."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / reps)
    return sorted(out)[len(out) // 2]
