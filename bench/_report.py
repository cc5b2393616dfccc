"""The benchmarks' one way to report: the results as JSON on stdout, and in ``$OUT/<name>.json``
when ``$OUT`` is set (the device machine sends that folder back); their one CUDA-event
timer, ``cuda_ms``, and ``rounds_ms`` for sweeps (every config timed once a round); and
``CardLog``, the card's clock, power and temperature while a run goes (an H200 at its 700 W
limit runs its SMs ~20% below their top clock, and a figure means little without it)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess


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
    out = sorted(cuda_window(fn, reps) for _ in range(iters))
    return out[len(out) // 2]


def cuda_window(fn, reps: int) -> float:
    """Milliseconds per call of ``fn`` over one CUDA-event window of ``reps`` back-to-back calls."""
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def rounds_ms(fns: dict, rounds: int = 7, reps: int = 10, window=cuda_window) -> dict:
    """Milliseconds per call of each of ``fns`` (key: call), timed in rounds: each round times
    every call once (one ``window`` of ``reps`` calls), starting one further along each round,
    and a call's figure is its median over the rounds. A card's clock drifts over a sweep (an
    idle H200 ramps from ~345 MHz, a busy one sinks to its power limit); timed one after
    another, the first and last configs of a sweep see different clocks, timed in rounds they
    see the same spread. Three warm-up calls each first."""
    keys = list(fns)
    for k in keys:
        for _ in range(3):
            fns[k]()
    got: dict = {k: [] for k in keys}
    for i in range(rounds):
        for k in keys[i % len(keys):] + keys[:i % len(keys)]:
            got[k].append(window(fns[k], reps))
    return {k: sorted(v)[len(v) // 2] for k, v in got.items()}


class CardLog:
    """``with CardLog(device_index) as log: ...``: ``nvidia-smi`` samples the card's SM clock
    (MHz), power draw (W) and temperature (C) every ``ms`` while the block runs;
    ``log.summary()`` gives each as ``[min, median, max]`` and the number of samples, or {}
    where there is no ``nvidia-smi`` or it printed nothing usable."""

    FIELDS = ("sm_mhz", "power_w", "temp_c")

    def __init__(self, index: int = 0, ms: int = 500):
        self.index, self.ms = index, ms
        self.proc: subprocess.Popen | None = None
        self.text = ""

    def __enter__(self) -> "CardLog":
        exe = shutil.which("nvidia-smi")
        if exe:
            self.proc = subprocess.Popen(
                [exe, "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits",
                 "-i", str(self.index), "-lms", str(self.ms)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.text, _ = self.proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.text, _ = self.proc.communicate()

    def summary(self) -> dict:
        return card_summary(self.text, self.FIELDS)


def card_summary(text: str, fields: tuple[str, ...] = CardLog.FIELDS) -> dict:
    """``nvidia-smi``'s csv lines (one value per field, no units) as ``{field: [min, median,
    max]}`` plus ``samples``; lines that do not parse (``[N/A]``, a cut-off last line) are
    skipped."""
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            rows.append([float(p) for p in parts])
        except ValueError:
            continue
    rows = [r for r in rows if len(r) == len(fields)]
    if not rows:
        return {}
    out = {f: [min(col), statistics.median(col), max(col)] for f, col in zip(fields, zip(*rows))}
    return {**out, "samples": len(rows)}
