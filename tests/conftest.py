"""Shared fixtures: small generated datasets and params built from plain dicts."""

from __future__ import annotations

import collections
import copy
import dataclasses
import os
from pathlib import Path
from typing import Any

# before anything loads OpenMP (torch, numpy's BLAS): threads waiting at a barrier sleep
# instead of spinning. The suite's processes (xdist workers, the stages DVC runs) share the
# cores, and a spinning wait burns the time another process would use: test_engines.py and
# test_export.py beside each other took 81 s with spinning and 52 s without on 2 cores
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import pytest
import yaml
from PIL import Image

from kohakumoss.config import Params
from kohakumoss.params import parse_params

ROOT = Path(__file__).resolve().parents[1]


def write_image(path: Path, w: int, h: int, seed: int = 0, mode: str = "RGB") -> Path:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    arr = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr, mode).save(path)
    return path


def make_kohya(root: Path, folders: dict[str, list[tuple[int, int]]], tags: bool = True) -> Path:
    """``folders``: folder name -> list of (w, h); writes PNGs with .txt tag sidecars."""
    n = 0
    for folder, sizes in folders.items():
        for i, (w, h) in enumerate(sizes):
            p = write_image(root / folder / f"img_{i:03d}.png", w, h, seed=n)
            if tags:
                p.with_suffix(".txt").write_text(f"tag{n}, shared, colour {n % 3}, extra_{i}")
            n += 1
    return root


def repo_params_raw() -> dict[str, Any]:
    """The repository's params.yaml as a mapping, on the random ``tiny`` components (the tests'
    reference vectors are of those, not of the demo pipeline the default run trains)."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["model"] = {**raw["model"], "transformer": "tiny", "text_encoder": "tiny", "vae": "tiny"}
    raw["caption"] = {**raw["caption"], "tokenizer": "tiny"}
    return raw


BASE: dict[str, Any] = {
    "run": {"seed": 0},
    "data": {"datasets": [], "scan_workers": 0, "num_workers": 0},
    "resolution": {"mode": "bucket", "target_area": 64 * 64, "aspect_range": [0.33, 3.0]},
    "caption": {"template": {"template": "tags", "shuffle": True, "tag_dropout": 0.1},
                "variants": 4, "text_drop": 0.2},
    "batching": {"mode": "tokens", "max_tokens": 96, "overlong": "drop_tokens"},
    "train": {"steps": 40, "grad_accum": 1},
    "parallel": {"world_size": 1},
}


def make_params(datasets: list[dict], **overrides: dict[str, Any]) -> Params:
    raw = copy.deepcopy(BASE)
    raw["data"]["datasets"] = datasets
    for section, values in overrides.items():
        raw.setdefault(section, {}).update(values)
    # params.yaml refuses world_size > 1 until the multi-GPU engine lands; the plan's and the
    # loader's rank split are library code already, tested on Params made directly
    world = raw["parallel"].pop("world_size", 1)
    p = parse_params(raw, "test-params.yaml")
    if world != 1:
        p = dataclasses.replace(p, parallel=dataclasses.replace(p.parallel, world_size=world))
    return p


@pytest.fixture
def kohya_dataset(tmp_path: Path) -> Path:
    return make_kohya(tmp_path / "ds", {
        "3_alpha": [(64, 64), (96, 48), (48, 96), (80, 60)],
        "1_beta": [(128, 32), (40, 40), (70, 90)],
    })


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: no error where it is absent
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): xdist's count of cores on a CPU machine; none (one
    process) where CUDA is present, so the ``gpu`` tests never share a device."""
    import torch

    return 0 if torch.cuda.is_available() else None


def pytest_collection_modifyitems(config, items):
    # the files that hold the most slow tests first: under pytest-xdist a file is one unit
    # of work, handed out in this order (--dist loadfile --no-loadscope-reorder), and a long
    # one handed out last would run alone at the end
    slow = collections.Counter(item.path for item in items if "slow" in item.keywords)
    items.sort(key=lambda item: -slow[item.path])  # stable: each file keeps its order
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run through the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# -- a machine without Linux's facilities ----------------------------------------------------
# The suite runs as on a machine without fcntl, /dev/shm, pidfds and the forkserver
# (kohakumoss/portable.py), every process it starts too; a test of a Linux path is marked
# ``native``. KMOSS_TEST_NATIVE=1 runs everything with this machine's own facilities.
if os.environ.get("KMOSS_TEST_NATIVE") != "1":
    os.environ["KMOSS_PORTABLE"] = "1"


@pytest.fixture(autouse=True)
def _native_when_marked(request, monkeypatch):
    if "native" in request.keywords:
        monkeypatch.delenv("KMOSS_PORTABLE", raising=False)
    yield
