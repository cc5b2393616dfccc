"""The modulated norm's row kernels at the model's sizes, over launches. (GPU, not a test.)

    PYTHONPATH=. python bench/bench_norm_launch.py [--tokens 8308 16800]

A joint block's halves open with the modulated norm, which the chain makes together with the
previous half's gated add (``JointBlock.chained``): a sampling step runs the kernel that
makes the add and the norm (``added``) 83 times at 8,308 tokens, a training step at 16,800
and, backward, the rows kernel that writes the stream's gradient and the branch's
(``gated``); ``forward`` (the plain norm) and ``rows`` (dx alone) run where the chain does
not. Each reads and writes whole [tokens, 3,072] bf16 rows, with the sample's fp32 shift,
scale and gate beside them. Per kind and token count, every launch (rows a program: 1, 2, 4;
warps: 2, 4, 8, 16) and the default, timed in rounds so a drifting clock favours none
(``_report.rounds_ms``): the median time, the bytes of the bf16 rows moved over the time,
whether the results equal the default launch's, and the fastest against the default. A
winner goes to ``triton_norm.LAUNCH``. Prints one JSON object
(``$OUT/bench_norm_launch.json`` on the device machine).
"""

from __future__ import annotations

import argparse
import itertools

import torch

from kohakumoss.kernels import backends
from _report import report, rounds_ms  # bench/_report.py (the script's folder is on sys.path)

D = 3072
ROWS_MOVED = {"forward": 2, "added": 4, "rows": 4, "gated": 5}  # bf16 rows read + written
LAUNCHES = tuple(itertools.product((1, 2, 4), (2, 4, 8, 16)))  # (rows a program, warps)


def row_calls(norm, x, y, go, res, w, mod, seg) -> dict:
    """Each row kernel of the norm as a call of a launch (``kind``: ``triton_norm.LAUNCH``'s
    keys; ``launch``: rows per program and warps, None the default) on rows ``x``, ``y`` (the
    added branch), ``go`` and ``res`` [N, D], a CFG pair's ``mod``."""
    return {
        "forward": lambda launch=None: [norm._forward(x, w, mod[:, 0], mod[:, 1], seg, 1e-6, True,
                                                      launch=launch)],
        "added": lambda launch=None: list(norm._forward(x, w, mod[:, 0], mod[:, 1], seg, 1e-6, True,
                                                        (y, mod[:, 2]), launch=launch)),
        "rows": lambda launch=None: [norm._backward(go, x, w, mod[:, 1], seg, 1e-6, True, False, False,
                                                    res, launch=launch)[0]],
        "gated": lambda launch=None: list(norm.backward_added(go, x, w, mod[:, 1], seg, 1e-6, res,
                                                              mod[:, 2], torch.bfloat16, launch=launch)),
    }


def launched(norm, kind: str, launch: tuple[int, int], call):
    """``call`` under ``launch`` (rows per program, warps) for ``kind``."""
    return lambda: call(launch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8308, 16800])
    a = ap.parse_args()
    norm = backends.triton_module("kernels.norm.triton")
    dev, g = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    out = {"device": torch.cuda.get_device_name(), "width": D, "kinds": {}}
    for N in a.tokens:
        x, y, go, res = (torch.randn(N, D, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(4))
        w = torch.randn(D, device=dev, generator=g, dtype=torch.bfloat16)
        mod = torch.randn(2, 6, D, device=dev, generator=g) * 0.3  # a CFG pair's modulation
        seg = torch.repeat_interleave(torch.arange(2, device=dev), torch.tensor([N // 2, N - N // 2], device=dev))
        calls = row_calls(norm, x, y, go, res, w, mod, seg)
        for kind, call in calls.items():
            want = call()
            fns, rows = {}, {}
            for launch in LAUNCHES:
                fns[launch] = launched(norm, kind, launch, call)
                try:
                    got = fns[launch]()
                    rows[launch] = {"launch": launch, "same": all(torch.equal(p, q) for p, q in zip(got, want))}
                except Exception as e:  # a launch that does not build (registers)
                    rows[launch] = {"launch": launch, "error": f"{type(e).__name__}: {str(e)[:120]}"}
                    del fns[launch]
            fns["default"] = call
            ms = rounds_ms(fns, reps=10)
            for launch, t in ms.items():
                if launch != "default":
                    rows[launch].update(us=round(t * 1e3, 1), gb_s=round(ROWS_MOVED[kind] * N * D * 2 / t / 1e6))
            timed = sorted((r for r in rows.values() if "us" in r), key=lambda r: r["us"])
            out["kinds"][f"{kind}/{N}"] = {"default": norm._launch(kind, D)[::2], "default_us": round(ms["default"] * 1e3, 1),
                                          "best": timed[0], "top": timed[:5],
                                          "failed": [r for r in rows.values() if "error" in r][:3]}
            print(kind, N, "default", norm._launch(kind, D)[::2], round(ms["default"] * 1e3, 1), "best", timed[0], flush=True)
    report(out, "bench_norm_launch")


if __name__ == "__main__":
    main()
