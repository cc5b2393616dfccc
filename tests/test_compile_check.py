"""The Triton kernels build for the cards they are offered on, checked without one
(``bench/check_compile.py``: every launch of a real-width training step compiled by Triton
for the target instead of run).

The interpreted suites (``test_kernel_backends.py`` and the others) check what the kernels
compute; this checks what only a compiler finds: a type the target lacks, a tile larger
than its shared memory. Among the launches: the chained norm's ``added`` forms forward and
backward, the narrow LoRA products, fp8 compute's row quantization (sm90), and a weight-only
fp8 base on an A100 (sm80, which has no e4m3 type: the codes go in as bytes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _compile(tmp_path: Path, arch: int, runs: list[str], *options: str) -> dict:
    triton = pytest.importorskip("triton")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this Triton has no bundled ptxas")
    out = tmp_path / f"sm{arch}.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path / "cache"),
               TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "check_compile.py"), "--arch", str(arch),
                           "--runs", *runs, "--json", str(out), *options], env=env, capture_output=True, text=True,
                          timeout=600)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert done.returncode == (1 if result["failed"] else 0), done.stderr[-3000:]
    return result


def _has(result: dict, kernel: str, **constants) -> bool:
    return any(k["kernel"] == kernel and all(k["constants"].get(n) == v for n, v in constants.items())
               for k in result["kernels"])


def test_the_training_kernels_build_for_an_h200(tmp_path):
    result = _compile(tmp_path, 90, ["lora", "full", "fp8-full", "sample-fp8"])
    assert result["failed"] == []
    assert all(k["error"] == "" and 0 < k["registers"] <= 255 for k in result["kernels"])
    assert _has(result, "_norm_fwd", ADDED=True)  # the chain: the add made by the next norm
    assert _has(result, "_norm_bwd_rows", GATED=True)  # and its backward
    assert _has(result, "_norm_bwd", WEIGHT_GRAD=True, MOD_GRAD=True)  # a full finetune's
    assert _has(result, "_fp8_rows") and _has(result, "_widen")
    assert any(k["run"] == "sample-fp8" and k["kernel"] == "_fp8_rows" and k["constants"]["TAIL"] == 0
               for k in result["kernels"])  # sampling over fp8 GEMMs: rows with no LoRA tail
    assert {k["run"] for k in result["kernels"]} == {"lora", "full", "fp8-full", "sample-fp8"}


def test_a_weight_only_fp8_base_builds_below_sm89(tmp_path):
    """Triton has no e4m3 type below sm89: the codes are decoded from their bytes there."""
    result = _compile(tmp_path, 80, ["fp8"])
    assert result["failed"] == []
    assert _has(result, "_qmm_fwd", BYTES=True) and _has(result, "_qmm_bwd", BYTES=True)
    assert not _has(result, "_qmm_fwd", BYTES=False)


def test_a_kernel_that_does_not_build_is_reported(tmp_path):
    """The check fails where the compiler does: e4m3 codes given as such to an A100."""
    result = _compile(tmp_path, 80, ["fp8"], "--e4m3-bytes", "off")
    assert result["failed"] and all("fp8e4nv" in line for line in result["failed"])
    assert {k["kernel"] for k in result["kernels"] if k["error"]} == {"_qmm_fwd", "_qmm_bwd"}
