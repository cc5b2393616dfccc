"""The row quantization of fp8 compute (``triton_fp8.fp8_rows_joined``) at the real model's
shapes, over launch configs. (GPU, not a test.)

    PYTHONPATH=. python bench/bench_fp8_rows.py [--tokens 16794] [--rank 32]

``precision.fp8_compute: full`` quantizes five kinds of rows a block (4 samples of 1 MP:
16,794 tokens): the forward's inputs with the LoRA tail (q|k|v, o and up|gate: 3,072
wide; ffn_down: 8,192) and the input gradients' ``dy * scale`` with theirs (q|k|v's three
3,072-wide sources as one row; o and ffn_down: 3,072; up|gate: 16,384). Each is bound by
memory: it reads the bf16 rows once (twice where a row does not fit the registers) and
writes one byte a column. Per shape and config (block, rows a program walks, their
pipeline stages, warps): the median time, every config timed once a round
(``_report.rounds_ms``), the bytes moved at one read over the time, and the fastest config against the one ``rows_launch`` picks.
Prints one JSON object (``$OUT/bench_fp8_rows.json`` on the device machine).
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from kohakumoss.quant import triton_fp8
from _report import report, rounds_ms  # bench/_report.py (the script's folder is on sys.path)

# name: (sources, width, column factors, tail rank as a multiple of --rank)
SHAPES = {"qkv_forward": (1, 3072, False, 3), "down_forward": (1, 8192, False, 1),
          "qkv_grad": (3, 3072, True, 1), "o_grad": (1, 3072, True, 1),
          "up_gate_grad": (1, 16384, True, 1)}


def configs(K: int, n: int):
    """Blocks: the whole row where it can be held (a power of two), else 2,048-8,192 wide
    chunks; rows 1, 2, 4 a program (two stages deep when more than one); 4, 8 or 16 warps,
    where each thread holds 8-64 values of a block."""
    blocks = [b for b in (2048, 4096, 8192) if b < K] + [triton.next_power_of_2(K)]
    for block, (rows, stages), warps in itertools.product(blocks, ((1, 1), (2, 2), (4, 2)), (4, 8, 16)):
        held = block * (n if block >= K else 1) // (32 * warps)
        if 8 <= held <= 64:
            yield block, rows, stages, warps


# --narrow: rows a block, columns a step, warps; each with one program a block and with 1 or 2
# programs an SM walking the blocks (the rows a program just read then fit L2 for its second read)
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16794)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--only", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    a = ap.parse_args()
    dev, g = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    out = {"device": torch.cuda.get_device_name(), "tokens": a.tokens, "rank": a.rank, "shapes": {}}
    for name in a.only:
        n, K, cols, r = SHAPES[name]
        xs = [torch.randn(a.tokens, K, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(n)]
        cs = torch.rand(n * K, device=dev, generator=g) + 0.5 if cols else None
        tail = (torch.randn(a.tokens, r * a.rank, device=dev, generator=g, dtype=torch.bfloat16),
                torch.rand(r * a.rank, device=dev, generator=g) * 4)
        moved = a.tokens * (n * K * 3 + r * a.rank * 3)  # bf16 in, e4m3 out, the tail alike
        want = triton_fp8.fp8_rows_joined(xs, cs, tail)
        rows, fns = [], {}
        for cfg in configs(K, n):
            fns[cfg] = lambda cfg=cfg: triton_fp8.fp8_rows_joined(xs, cs, tail, launch=cfg)
            try:
                got = fns[cfg]()
                same = torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and \
                    torch.equal(got[1], want[1])
            except Exception as e:  # a config that does not build (registers, shared memory)
                rows.append({"config": cfg, "error": f"{type(e).__name__}: {str(e)[:120]}"})
                del fns[cfg]
                continue
            rows.append({"config": cfg, "same": same})
        ms = rounds_ms(fns, reps=10)
        for x in rows:
            if "same" in x:
                x.update(us=round(ms[x["config"]] * 1e3, 1), gb_s=round(moved / ms[x["config"]] / 1e6))
        timed = [x for x in rows if "us" in x]
        picked = triton_fp8.rows_launch(K, n)
        now = next((x for x in timed if tuple(x["config"]) == picked), None)
        best = min(timed, key=lambda x: x["us"])
        out["shapes"][name] = {"picked": now, "best": best,
                               "all": sorted(timed, key=lambda x: x["us"])[:8],
                               "failed": [x for x in rows if "error" in x][:4]}
        print(name, "picked", now, "best", best, flush=True)
    report(out, "bench_fp8_rows")


if __name__ == "__main__":
    main()
