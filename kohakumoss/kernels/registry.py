"""The kernel registry: each op of the op table (``kohakumoss.model.ops``) maps to its
reference and to the backends that may replace it, each declaring when it can run.

``build_op_table(device, dtype, choices)`` makes one model's table: per op, the first
backend of ``choices[op]`` that can run on ``(device, dtype)``, else the reference. Every
name in ``choices`` is checked first, so a typo is an error even where the backend could
not have run anyway. The dispatch is logged once per distinct ``(device, dtype, dispatch)``,
naming any chosen backend that could not run. ``docs/engines.md`` says how to add a backend.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence

import torch

from kohakumoss.errors import KohakuError
from kohakumoss.model.ops import REFERENCE, OpTable

log = logging.getLogger(__name__)

REFERENCE_NAME = "reference"

Choices = Mapping[str, str | Sequence[str]]


class KernelError(KohakuError):
    """An unknown op or backend name, or a backend name taken twice."""


@dataclasses.dataclass(frozen=True)
class Backend:
    op: str
    name: str
    fn: Callable
    available: Callable[[torch.device, torch.dtype], bool]  # can it run on (device, dtype)?


class KernelRegistry:
    def __init__(self):
        self._backends: dict[str, dict[str, Backend]] = {op: {} for op in REFERENCE}
        self._logged: set[tuple] = set()

    def _op(self, op: str) -> dict[str, Backend]:
        if op not in self._backends:
            raise KernelError(f"unknown op {op!r}; the op table has {', '.join(self._backends)}")
        return self._backends[op]

    def register(self, op: str, name: str, fn: Callable,
                 available: Callable[[torch.device, torch.dtype], bool]) -> Backend:
        """Add backend ``name`` of ``op``: ``fn`` has the reference's signature and results;
        ``available(device, dtype)`` says whether it can run there."""
        backends = self._op(op)
        if name == REFERENCE_NAME or name in backends:
            raise KernelError(f"op {op!r} already has a backend named {name!r}; pick another name")
        backends[name] = Backend(op, name, fn, available)
        return backends[name]

    def unregister(self, op: str, name: str) -> None:
        self.backend(op, name)
        del self._backends[op][name]

    def names(self, op: str) -> list[str]:
        """``reference`` and the registered backends of ``op``."""
        return [REFERENCE_NAME, *self._op(op)]

    def backend(self, op: str, name: str) -> Backend:
        backends = self._op(op)
        if name not in backends:
            raise KernelError(f"op {op!r} has no backend {name!r}; it has "
                              f"{', '.join(self.names(op))}")
        return backends[name]

    def dispatch(self, device: torch.device | str, dtype: torch.dtype,
                 choices: Choices | None = None) -> tuple[dict[str, str], dict[str, list[str]]]:
        """``({op: backend name}, {op: chosen backends that cannot run here})``."""
        device = torch.device(device)
        wanted = {op: [names] if isinstance(names, str) else list(names)
                  for op, names in (choices or {}).items()}
        for op, names in wanted.items():
            for name in names:
                if name != REFERENCE_NAME:
                    self.backend(op, name)
        chosen, unable = {}, {}
        for op in self._backends:
            chosen[op] = REFERENCE_NAME
            for name in wanted.get(op, []):
                if name == REFERENCE_NAME or self.backend(op, name).available(device, dtype):
                    chosen[op] = name
                    break
                unable.setdefault(op, []).append(name)
        return chosen, unable

    def build_op_table(self, device: torch.device | str, dtype: torch.dtype,
                       choices: Choices | None = None) -> OpTable:
        """A new table for one model computing in ``dtype`` on ``device``."""
        device = torch.device(device)
        chosen, unable = self.dispatch(device, dtype, choices)
        table = OpTable()
        for op, name in chosen.items():
            if name != REFERENCE_NAME:
                table.override(op, self.backend(op, name).fn)
        key = (str(device), dtype, tuple(chosen.items()), tuple((k, tuple(v)) for k, v in unable.items()))
        if key not in self._logged:
            self._logged.add(key)
            picked = [f"{op}={name}" for op, name in chosen.items() if name != REFERENCE_NAME]
            notes = [f"{op}: {', '.join(names)} cannot run here" for op, names in unable.items()]
            log.info("kernels on %s/%s: %s%s", device, str(dtype).removeprefix("torch."),
                     ", ".join(picked) + ", the rest reference" if picked else "every op reference",
                     f" ({'; '.join(notes)})" if notes else "")
        return table


KERNELS = KernelRegistry()
"""The process's registry: backends register here when their module is imported."""


def register_backend(op: str, name: str, fn: Callable,
                     available: Callable[[torch.device, torch.dtype], bool]) -> Backend:
    return KERNELS.register(op, name, fn, available)


def build_op_table(device: torch.device | str, dtype: torch.dtype,
                   choices: Choices | None = None) -> OpTable:
    return KERNELS.build_op_table(device, dtype, choices)
