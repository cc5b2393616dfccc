"""The Triton kernels compiled for a GPU this machine does not have, at the real sizes (not a test).

    PYTHONPATH=. python bench/check_compile.py [--arch 90 80] [--runs lora full fp8-full ...]

A kernel that the interpreter runs (the CPU tests) can still fail on a card: a block too
large for its shared memory, a type the compiler refuses, registers spilled to local memory.
This finds those without a GPU. Each run builds the base flavor's DiT at its real widths
(two joint blocks, one text block, about 150 tokens: the launches depend on the widths,
not the token count), gives it the Triton op table, and makes one training step (forward and
backward; ``sample``: one packed CFG forward) on the CPU. Every Triton launch on the way is
compiled by Triton for ``sm<arch>`` (its bundled ``ptxas``) instead of being run: the kernels'
outputs are left unwritten, the rest of the step (the references, torch's products) runs on
the CPU as usual, and ``torch._scaled_mm`` returns unwritten tensors of its result's shape.

Printed: one line per compiled kernel variant (warps, stages, registers, shared memory,
spilled bytes) and a JSON summary. Exit status 1 when a kernel fails to compile or asks for
more shared memory than the card has; spills are reported, not failed.

Runs: ``lora`` (rank-32 LoRA, bf16), ``full`` (full finetune, bf16: the weight and
modulation gradients), ``fp16`` (LoRA, fp16 compute, the stream scaled), ``fp32``, ``int8``
and ``fp8`` (weight-only bases), ``fp8-full`` (fp8 compute with fp8 input gradients),
``sample`` (no gradients, a prompt and a negative packed), ``sample-fp8`` (the same over fp8
GEMMs, as ``kmoss sample`` with ``precision.fp8_compute: on``); and ``sweeps``: every launch
config the GPU sweeps time (fp8 rows, the norm's row kernels), so a
config that cannot build is known before device time is spent on it. The Triton the
machine has does the compiling: its version is printed (the H200 image has 3.6: install
that one beside, ``pip install --target DIR triton==3.6.0`` and ``PYTHONPATH=DIR:.``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

# the largest shared memory a block may ask for (bytes, opt-in), per compute capability
SHARED_LIMIT = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448,
                120: 101376}
RUNS = ("lora", "full", "fp16", "fp32", "int8", "fp8", "fp8-full", "sample", "sample-fp8")


@dataclasses.dataclass
class Compiled:
    kernel: str
    constants: dict
    warps: int
    stages: int
    shared: int = 0
    registers: int = 0
    spilled: int = 0  # stack (spilled registers) and local memory, bytes a thread
    error: str = ""


class _Driver:
    """What Triton's launcher asks of a driver before it compiles: a device, a stream and the
    target. Anything else (loading a module, launching) is not there to ask."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):  # a kernel keeps its compiled variants per device: one per arch
        return f"sm{self.target.arch}"

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def is_active(self):
        return True

    def __getattr__(self, name):
        raise AttributeError(f"no GPU driver here (compile only): {name}")


def _resources(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes a thread: where registers spill) of a cubin's kernel, by
    ``cuobjdump --dump-resource-usage``."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    fields = dict(part.split(":", 1) for line in out.splitlines() if "REG:" in line
                  for part in line.split() if ":" in part)
    return int(fields.get("REG", 0)), int(fields.get("STACK", 0)) + int(fields.get("LOCAL", 0))


@contextlib.contextmanager
def compile_only(arch: int, e4m3_bytes: bool | None = None):
    """Within: Triton launches compile for ``sm<arch>`` and do not run; the Triton backends
    (and fp8 compute's) count as available on the CPU; fp8 codes go to the kernels as bytes
    where the card would give them so (``e4m3_bytes``: forced). Yields the ``Compiled``."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import autotuner, driver, jit

    from kohakumoss.kernels import KERNELS, triton_common
    from kohakumoss.quant import triton_quant

    seen: dict[str, Compiled] = {}
    out: list[Compiled] = []

    def run(self, *args, grid, warmup, **kwargs):
        try:
            kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as e:  # the compiler's refusal is the finding (once per variant)
            names = [p.name for p in self.params]
            constants = {k: v for k, v in kwargs.items() if k in names}
            key = repr((self.__name__, constants, kwargs.get("num_warps"), kwargs.get("num_stages")))
            if key not in seen:
                seen[key] = Compiled(self.__name__, constants, kwargs.get("num_warps", 4),
                                     kwargs.get("num_stages", 3), error=f"{type(e).__name__}: {e}"[:400])
                out.append(seen[key])
            return None
        if kernel.hash not in seen:
            md = kernel.metadata
            constants = {p.name: kwargs[p.name] for p in self.params if p.is_constexpr and p.name in kwargs}
            seen[kernel.hash] = Compiled(self.__name__, constants, md.num_warps, md.num_stages, md.shared,
                                         *_resources(kernel.asm["cubin"]))
            out.append(seen[kernel.hash])
        return kernel

    def tuned_run(self, *args, grid=None, warmup=False, **kwargs):  # every config, none timed
        for config in self.configs:
            self.fn.run(*args, grid=grid, warmup=True, **kwargs, **config.all_kwargs())

    def scaled_mm(a, b, scale_a=None, scale_b=None, bias=None, scale_result=None, out_dtype=None,
                  use_fast_accum=False):
        return torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype or a.dtype, device=a.device)

    saved_driver = driver._active  # None: the default, made on first use (none without a GPU)
    original_run, original_tuned = jit.JITFunction.run, autotuner.Autotuner.run
    backends = {(op, name): b for op, named in KERNELS._backends.items() for name, b in named.items()
                if name in ("triton", "dequant_mm", "scaled_mm")}
    saved = (triton_common.can_run, dict(triton_common._RUNS), torch._scaled_mm, triton_quant.E4M3_BYTES)
    driver.set_active(_Driver(GPUTarget("cuda", arch, 32)))
    jit.JITFunction.run, autotuner.Autotuner.run = run, tuned_run
    triton_common.can_run = lambda device: True
    triton_common._RUNS.clear()
    torch._scaled_mm = scaled_mm
    triton_quant.E4M3_BYTES = arch < 89 if e4m3_bytes is None else e4m3_bytes  # as the card would
    for (op, name), b in backends.items():
        KERNELS._backends[op][name] = dataclasses.replace(b, available=lambda device, dtype: True)
    try:
        yield out
    finally:
        for (op, name), b in backends.items():
            KERNELS._backends[op][name] = b
        triton_common.can_run, runs, torch._scaled_mm, triton_quant.E4M3_BYTES = saved
        triton_common._RUNS.clear()
        triton_common._RUNS.update(runs)
        jit.JITFunction.run, autotuner.Autotuner.run = original_run, original_tuned
        driver._active = saved_driver


def _model(run: str, blocks: int):
    """The base flavor's DiT at its real widths with ``blocks`` joint blocks, its engines
    applied for ``run`` on the CPU, and an adapter where the run trains one."""
    from kohakumoss.adapters import apply_adapters
    from kohakumoss.config import AdapterConfig
    from kohakumoss.kernels.backends import TRITON_OPS
    from kohakumoss.model import FLAVORS
    from kohakumoss.model.build import random_transformer
    from kohakumoss.precision import precision_policy
    from kohakumoss.training.engines import EnginePlan, apply_engines

    config = dataclasses.replace(FLAVORS["base"], depth=blocks, text_blocks=1, negative_skip_layers=(1,))
    model = random_transformer(config, "cpu")
    dtype = {"fp16": "fp16", "fp32": "fp32"}.get(run, "bf16")
    base = {"int8": "int8", "fp8": "fp8", "fp8-full": "fp8", "sample-fp8": "fp8"}.get(run, "keep")
    policy = precision_policy(dtype, full=run == "full", base=base,
                              fp8_compute=run in ("fp8-full", "sample-fp8"), fp8_grad=run == "fp8-full")
    kernels = {op: ["triton"] for op in TRITON_OPS}
    apply_engines(model, EnginePlan(torch.device("cpu"), policy, kernels=kernels))
    if run != "full" and not run.startswith("sample"):
        apply_adapters(model, AdapterConfig(algo="lora", dim=32, alpha=32.0), seed=0)
    if run.startswith("sample"):
        model.requires_grad_(False)
    return model, policy.compute


def step(run: str, blocks: int = 2, image: int = 64, text: int = 24) -> None:
    """One training step of ``run`` (``sample``, ``sample-fp8``: a CFG forward) on two samples of ``image``
    image tokens (square) and ``text`` / ``text - 8`` text tokens."""
    from kohakumoss.diffusion.objective import flow_loss
    from kohakumoss.model import build_layout

    model, dtype = _model(run, blocks)
    side = int(image ** 0.5)
    texts = [text, text - 8]
    layout = build_layout([(side, side)] * 2, texts)
    c = model.config
    z = torch.randn(2 * side * side, c.latent_channels, dtype=dtype)
    words = torch.randn(sum(texts), c.text_dim, dtype=dtype)
    sigma = torch.rand(2)
    with torch.no_grad() if run.startswith("sample") else contextlib.nullcontext():
        pred = model(z, words, sigma, layout)
        if not run.startswith("sample"):
            loss = flow_loss(pred, torch.randn_like(pred, dtype=torch.float32), layout.seg_img,
                             torch.ones(2), layout.n_img)
            loss.backward()


def sweeps() -> None:
    """The launches the GPU sweeps time, each made once on a few rows (the launches depend on
    the widths): ``bench_fp8_rows.py``'s configs at its five shapes,
    and ``bench_norm_launch.py``'s for each row kernel of the norm."""
    import bench_fp8_rows
    import bench_norm_launch
    from kohakumoss.kernels.norm import triton as triton_norm
    from kohakumoss.quant import triton_fp8

    g, rows, bf16 = torch.Generator().manual_seed(0), 8, torch.bfloat16
    for name, (n, K, cols, r) in bench_fp8_rows.SHAPES.items():
        xs = [torch.randn(rows, K, generator=g).to(bf16) for _ in range(n)]
        cs = torch.rand(n * K, generator=g) + 0.5 if cols else None
        tail = (torch.randn(rows, r * 32, generator=g).to(bf16), torch.rand(r * 32, generator=g))
        for config in bench_fp8_rows.configs(K, n):
            triton_fp8.fp8_rows_joined(xs, cs, tail, launch=config)
    D = bench_norm_launch.D
    x, y, go, res = (torch.randn(rows, D, generator=g).to(bf16) for _ in range(4))
    w, mod = torch.randn(D, generator=g).to(bf16), torch.randn(2, 6, D, generator=g)
    seg = torch.tensor([0] * (rows // 2) + [1] * (rows - rows // 2))
    for kind, call in bench_norm_launch.row_calls(triton_norm, x, y, go, res, w, mod, seg).items():
        for launch in bench_norm_launch.LAUNCHES:
            call(launch)


def problem(k: Compiled, arch: int) -> str:
    """Why kernel ``k`` cannot run on ``sm<arch>`` ("" when it can)."""
    limit = SHARED_LIMIT.get(arch, min(SHARED_LIMIT.values()))
    return k.error or (f"shared memory {k.shared} > {limit} bytes" if k.shared > limit else "")


def check(arch: int, run: str, blocks: int = 2, e4m3_bytes: bool | None = None
          ) -> tuple[list[Compiled], list[str]]:
    """``run``'s kernels compiled for ``sm<arch>`` (``sweeps``: the sweeps' launches), and
    what fails there (one line each)."""
    with compile_only(arch, e4m3_bytes) as compiled:
        sweeps() if run == "sweeps" else step(run, blocks)
    return compiled, [f"sm{arch}/{run}/{k.kernel}: {problem(k, arch)}" for k in compiled
                      if problem(k, arch)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80],
                        help="compute capabilities to compile for, e.g. 90 (H100/H200), 80 (A100), "
                             "86 (RTX 30), 89 (Ada)")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=[*RUNS, "sweeps"],
                        help="the steps to compile (default: all); sweeps: the launches "
                             "bench_fp8_rows and bench_norm_launch time")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--json", help="also write every compiled kernel here")
    parser.add_argument("--e4m3-bytes", choices=["auto", "on", "off"], default="auto",
                        help="fp8 codes to the kernels as bytes: as the card would (below sm89), "
                             "or forced")
    args = parser.parse_args()
    import triton

    print(f"triton {triton.__version__}, torch {torch.__version__}", flush=True)
    torch.set_flush_denormal(True)  # the kernels' outputs are left unwritten: no slow subnormals
    failed, summary, kernels = [], {}, []
    for arch in args.arch:
        for run in args.runs:
            if run in ("fp8-full", "sample-fp8") and arch < 89:
                continue  # fp8 compute needs sm89+ (the precision policy refuses it there)
            t0 = time.perf_counter()
            compiled, bad = check(arch, run, args.blocks,
                                  {"auto": None, "on": True, "off": False}[args.e4m3_bytes])
            failed += bad
            summary[f"sm{arch}/{run}"] = {"kernels": len(compiled), "failed": len(bad),
                                          "seconds": round(time.perf_counter() - t0, 1)}
            for k in compiled:
                kernels.append({"arch": arch, "run": run, **dataclasses.asdict(k)})
                why = problem(k, arch)
                flag = "FAIL" if why else ("spills" if k.spilled else "ok")
                consts = ",".join(f"{n}={v}" for n, v in k.constants.items())
                print(f"sm{arch} {run:9s} {flag:6s} {k.kernel:22s} warps={k.warps} stages={k.stages} "
                      f"regs={k.registers} shared={k.shared} stack={k.spilled} [{consts}] "
                      f"{why.splitlines()[-1] if why else ''}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "kernels": kernels, "failed": failed}, f, indent=1)
    print(json.dumps({"summary": summary, "failed": failed}, indent=1))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
