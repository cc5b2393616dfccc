"""Training timestep (sigma) distributions (``docs/diffusion.md#training-timestep-distributions``).

"Timesteps" here is always the distribution sigmas are drawn from in training; "sampler"
means only the inference (Euler) sampler of ``diffusion/sampler.py``.

Sigma 0 is data, 1 is pure noise. The MOSS distribution is a discrete truncated logit-normal
pmf over a 1000-point grid, computed in float32 tensor ops exactly as the reference does
(the vectors' tables match it bit for bit, see ``moss_tables``); a staged table switches
its knobs at given global steps ("tech_report"). ``uniform`` and ``logit_normal`` are the
usual continuous distributions. Every draw is a pure function of (seed, global batch index): no
generator state to checkpoint, and a resumed run draws the same sigmas.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import load_file

from kohakumoss.seeding import seed_of

TECH_REPORT = (
    (0, {"mu": 0.0, "s": 1.0, "shift": 3.0, "cutoff": None, "p_full": 0.01}),
    (140_000, {"mu": -1.45, "s": 1.05, "shift": 1.0, "cutoff": None, "p_full": 0.01}),
    (207_000, {"mu": -1.45, "s": 1.05, "shift": 1.0, "cutoff": 0.95, "p_full": 0.0}),
    (274_000, {"mu": -1.09, "s": 0.95, "shift": 1.0, "cutoff": 0.95, "p_full": 0.0}),
)
STAGE_DEFAULTS = {"mu": 0.0, "s": 1.0, "cutoff": None, "p_full": 0.0, "shift": 1.0}


def shift_sigma(x: torch.Tensor, k: float) -> torch.Tensor:
    """The static shift ``k x / (1 + (k - 1) x)`` (identity at k = 1)."""
    return x if k == 1.0 else k * x / (1 + (k - 1) * x)


def compute_moss_tables(steps: int = 1000, mu: float = -1.09, s: float = 0.95,
                        cutoff: float | None = 0.95, uniform_mix: float = 0.01, p_full: float = 0.0,
                        shift: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pmf, sigma, cdf), each float32 [steps], with this process's math library.

    Bin j (0-based) has sigma ``shift((j+1)/N)``. Use :func:`moss_tables`, which pins the
    math library's code path so that every machine gets the same bits.
    """
    n, a = steps, 1.0 if cutoff is None else cutoff
    x = a * torch.arange(n + 1, dtype=torch.float32) / n
    arg = (torch.log(x) - torch.log1p(-x) + mu) / (s * math.sqrt(2))
    cdf_x, sf_x = 0.5 * torch.erfc(-arg), 0.5 * torch.erfc(arg)
    cdf_x[0], sf_x[0] = 0.0, 1.0
    cdf_x[x >= 1], sf_x[x >= 1] = 1.0, 0.0
    # each bin from the side where it does not cancel: CDF below the median, SF above
    mass = torch.where(cdf_x[1:] <= 0.5, cdf_x[1:] - cdf_x[:-1], sf_x[:-1] - sf_x[1:])
    mass = mass / cdf_x[n].clamp_min(torch.finfo(torch.float32).tiny)
    pmf = (1 - uniform_mix) * mass + uniform_mix / n
    pmf = pmf * (1 - p_full)
    pmf[-1] += p_full
    pmf = pmf / pmf.sum()
    sigma = shift_sigma(torch.arange(1, n + 1, dtype=torch.float32) / n, shift)
    cdf = torch.cumsum(pmf, 0)
    cdf[-1] = 1.0
    return pmf, sigma, cdf


# torch computes float32 log and erfc on x86 with MKL's vector math, whose result depends on
# the code path MKL picks for the CPU: AVX-512 and AVX2 paths round about 3% of these values
# 1 ulp differently from MKL's SSE path (the one it takes on AMD CPUs), which made the
# reference tables: under it they match the vectors bit for bit. MKL's "conditional numerical
# reproducibility" mode COMPATIBLE gives that path's bits on every x86 CPU, but it is chosen
# per process, before MKL's first call, and would slow everything else down; so the tables
# are computed once per knob set in a short child process that has it.
_PINNED_ENV = {"MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
_CHILD = ("import json, sys\n"
          "from safetensors.torch import save_file\n"
          "from kohakumoss.diffusion.timesteps import compute_moss_tables\n"
          "pmf, sigma, cdf = compute_moss_tables(**json.loads(sys.argv[1]))\n"
          "save_file({'pmf': pmf, 'sigma': sigma, 'cdf': cdf}, sys.argv[2])\n")


def _math_path_is_pinned() -> bool:
    return (not torch.backends.mkl.is_available()
            or os.environ.get("MKL_CBWR", "").upper().startswith("COMPATIBLE"))


def _tables_in_pinned_child(knobs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, **_PINNED_ENV,
           "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    with tempfile.TemporaryDirectory(prefix="kmoss-tables-") as tmp:
        out = Path(tmp) / "tables.safetensors"
        done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(knobs), str(out)],
                              env=env, capture_output=True, timeout=300, check=False)
        if done.returncode != 0 or not out.is_file():
            lines = done.stderr.decode(errors="replace").strip().splitlines()
            raise RuntimeError(lines[-1] if lines else f"the child exited with {done.returncode}")
        tables = load_file(str(out))
    return tables["pmf"], tables["sigma"], tables["cdf"]


@lru_cache(maxsize=16)
def moss_tables(steps: int = 1000, mu: float = -1.09, s: float = 0.95, cutoff: float | None = 0.95,
                uniform_mix: float = 0.01, p_full: float = 0.0, shift: float = 1.0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pmf, sigma, cdf), each float32 [steps]: the same bits on every x86 CPU (for one MKL)."""
    knobs = dict(steps=steps, mu=mu, s=s, cutoff=cutoff, uniform_mix=uniform_mix, p_full=p_full,
                 shift=shift)
    if not _math_path_is_pinned():
        try:
            return _tables_in_pinned_child(knobs)
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            warnings.warn(f"computing the MOSS timestep tables in this process ({err}); they may "
                          "differ from another machine's in the last bit. Setting MKL_CBWR="
                          "COMPATIBLE in the environment avoids the child process.", stacklevel=2)
    return compute_moss_tables(**knobs)


@dataclasses.dataclass(frozen=True)
class MossTimesteps:
    steps: int = 1000
    mu: float = -1.09
    s: float = 0.95
    cutoff: float | None = 0.95
    uniform_mix: float = 0.01
    p_full: float = 0.0
    shift: float = 1.0
    schedule: tuple = ()  # ((start_step, {knobs}), ...) or () for one stage

    def knobs_at(self, step: int) -> dict:
        """The table knobs in force at global ``step``; a stage may also set ``uniform_mix``."""
        base = {"mu": self.mu, "s": self.s, "cutoff": self.cutoff, "p_full": self.p_full,
                "shift": self.shift, "uniform_mix": self.uniform_mix}
        if not self.schedule:
            return base
        stage = [knobs for start, knobs in self.schedule if start <= step][-1]
        return {**STAGE_DEFAULTS, "uniform_mix": self.uniform_mix, **dict(stage)}

    def tables(self, step: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return moss_tables(self.steps, **self.knobs_at(step))

    def sample(self, n: int, generator: torch.Generator, step: int = 0) -> torch.Tensor:
        _, sigma, cdf = self.tables(step)
        u = torch.rand(n, generator=generator)
        idx = torch.searchsorted(cdf, u).clamp_max(self.steps - 1)
        return sigma[idx]


@dataclasses.dataclass(frozen=True)
class UniformTimesteps:
    low: float = 0.001
    high: float = 1.0
    shift: float = 1.0

    def sample(self, n: int, generator: torch.Generator, step: int = 0) -> torch.Tensor:
        u = torch.rand(n, generator=generator)
        return shift_sigma(self.low + (self.high - self.low) * u, self.shift)


@dataclasses.dataclass(frozen=True)
class LogitNormalTimesteps:
    mu: float = 0.0
    s: float = 1.0
    shift: float = 1.0

    def sample(self, n: int, generator: torch.Generator, step: int = 0) -> torch.Tensor:
        z = torch.randn(n, generator=generator)
        return shift_sigma(torch.sigmoid(self.mu + self.s * z), self.shift)


def batch_sigmas(timesteps, n: int, seed: int, global_batch: int, step: int) -> torch.Tensor:
    """The sigmas of one batch: a pure function of (seed, global batch index, step)."""
    g = torch.Generator().manual_seed(seed_of("sigma", int(seed), int(global_batch)) & (2**63 - 1))
    return timesteps.sample(n, g, step)
