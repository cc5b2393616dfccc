"""The kernel tuning table: what the tuner measured, per device signature, as one JSON file
with a manifest (``kohakumoss.artifacts``), written by ``kmoss tune_kernels``.

``table.json``::

    {"kind": "kernel_table", "schema": 1,
     "devices": {"<signature key>": {
        "signature": {"device": "cuda", "name": "NVIDIA H200", "arch": "sm90",
                      "torch": "2.13.0", "cuda": "12.8", "triton": "3.5.0", "tilelang": "",
                      "kernels": "<version + hash of kernels/**/*.py and model/ops.py>"},
        "entries": {"situ/bfloat16/N=24576,F=8192": {
            "order": ["triton", "compile", "reference"],     # fastest first
            "ms": {"reference": 3.1, "compile": 1.2, "triton": 0.9},   # forward + backward
            "failed": {"tilelang": "ImportError: ..."},
            "shape": {"N": 16800, "F": 8192},                  # the shape timed
            "grads": "activations"}},                          # or "all" (full finetune)
        "tuning": {"first_run": {...}, "last_run": {...}, "total_seconds": 41.0}}}}

A table is trusted only where its section's signature equals this process's: the device
(GPU name and compute capability, or CPU model), the torch / CUDA / Triton / TileLang
versions and the kernel sources. ``read_table`` checks the bytes against the manifest first:
a changed or truncated table is an ``IntegrityError``, never read.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from kohakumoss.artifacts import (Manifest, atomic_write_text, code_version, hash_json,
                                  make_manifest, read_manifest, verify_files, write_manifest)
from kohakumoss.errors import IntegrityError

KIND = "kernel_table"
SCHEMA = 1
TABLE = "table.json"
KERNEL_SOURCES = ("kohakumoss.kernels", "kohakumoss.model.ops")
DEVICE_FIELDS = ("device", "name", "arch")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


@functools.cache
def kernel_sources() -> str:
    """The package version and a hash of every kernel source file and the op contract, read
    once per process (the code that runs is the code imported, whatever changes on disk)."""
    return code_version(*KERNEL_SOURCES)


def device_signature(device: torch.device | str) -> dict[str, str]:
    """What a measurement holds for: the device, the software, the kernel sources."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        arch = "sm%d%d" % torch.cuda.get_device_capability(index)
    else:
        name, arch = _cpu_model(), platform.machine()
    return {"device": device.type, "name": name, "arch": arch, "torch": torch.__version__,
            "cuda": torch.version.cuda or "", "triton": _version("triton"),
            "tilelang": _version("tilelang"), "flash_attn_4": _version("flash-attn-4"),
            "kernels": kernel_sources()}


def signature_key(signature: dict[str, str]) -> str:
    return hash_json(signature)[:16]


def describe(signature: dict[str, str]) -> str:
    """``NVIDIA H200 (cuda sm90)``."""
    return f"{signature.get('name', '?')} ({signature.get('device', '?')} {signature.get('arch', '?')})"


@dataclasses.dataclass
class KernelTable:
    devices: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def section(self, signature: dict[str, str]) -> dict[str, Any] | None:
        """The section measured under exactly ``signature``, or None."""
        found = self.devices.get(signature_key(signature))
        return found if found is not None and found.get("signature") == signature else None

    def why_not(self, signature: dict[str, str]) -> str:
        """Why no section is for ``signature``, in words: another device, or this device
        with other software or other kernel sources."""
        if not self.devices:
            return "it holds no measurements"
        same = [s for s in self.devices.values()
                if all(s["signature"].get(f) == signature[f] for f in DEVICE_FIELDS)]
        if not same:
            theirs = ", ".join(sorted({describe(s["signature"]) for s in self.devices.values()}))
            return f"it is for another device ({theirs}; this is {describe(signature)})"
        diff = [f"{k} {same[0]['signature'].get(k) or 'none'} there, {v or 'none'} here"
                for k, v in signature.items() if same[0]["signature"].get(k) != v]
        what = "other kernel sources" if diff and all(d.startswith("kernels ") for d in diff) \
            else "other software"
        return f"it was measured on this device ({describe(signature)}) with {what} ({'; '.join(diff)})"

    def to_json(self) -> dict[str, Any]:
        return {"kind": KIND, "schema": SCHEMA, "devices": self.devices}

    @classmethod
    def from_json(cls, data: Any, where: str) -> KernelTable:
        ok = (isinstance(data, dict) and data.get("kind") == KIND and data.get("schema") == SCHEMA
              and isinstance(data.get("devices"), dict)
              and all(isinstance(s, dict) and isinstance(s.get("signature"), dict)
                      and isinstance(s.get("entries"), dict) for s in data["devices"].values()))
        if not ok:
            raise IntegrityError(f"{where} is not a kernel tuning table of schema {SCHEMA}; "
                                 f"rebuild it with `kmoss tune_kernels` (or `dvc repro`)")
        return cls(dict(data["devices"]))


def winners(section: dict[str, Any] | None) -> dict[str, list[str]]:
    """``{entry key: backend names, fastest first}``: what ``build_op_table(tuned=...)`` takes."""
    if not section:
        return {}
    return {key: list(entry["order"]) for key, entry in section["entries"].items()}


def read_table(directory: str | Path) -> KernelTable:
    """The table in ``directory``, checked against its manifest: a missing manifest is an
    ``ArtifactError``; a table whose bytes changed, or that does not parse, an
    ``IntegrityError`` (it is never trusted)."""
    directory = Path(directory)
    manifest = read_manifest(directory, KIND, made_by="tune_kernels")
    path = directory / TABLE
    if verify_files(directory, manifest):
        raise IntegrityError(f"{path} does not match its manifest (changed, truncated or missing): "
                             f"it is not trusted; rebuild it with `kmoss tune_kernels` "
                             f"(or `dvc repro`)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IntegrityError(f"{path} is unreadable ({e}); rebuild it with `kmoss tune_kernels` "
                             f"(or `dvc repro`)") from None
    return KernelTable.from_json(data, str(path))


def write_table(directory: str | Path, table: KernelTable, *, params: dict[str, Any],
                inputs: dict[str, Manifest], info: dict[str, Any], write: bool = True) -> Manifest:
    """Write ``table.json`` (unless ``write`` is False: the bytes on disk are current) and
    the manifest, each atomically."""
    directory = Path(directory)
    if write or not (directory / TABLE).is_file():
        atomic_write_text(directory / TABLE,
                          json.dumps(table.to_json(), indent=1, sort_keys=True) + "\n")
    manifest = make_manifest(KIND, SCHEMA, params=params, inputs=inputs, code=kernel_sources(),
                             directory=directory, files=[TABLE], info=info)
    write_manifest(directory, manifest)
    return manifest
