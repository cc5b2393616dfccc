"""The kernel registry: each op of the op table (``kohakumoss.model.ops``) maps to its
reference and to the backends that may replace it, each declaring where it can run
(``available(device, dtype)``) and, optionally, which problem shapes it takes
(``fits(dims)``, see ``kohakumoss.kernels.problems``; default: any shape).

``build_op_table(device, dtype, choices, tuned)`` makes one model's table. Per op:

- a static choice (``choices[op]``, an ordered list): the first backend that can run on
  ``(device, dtype)``, else the reference. Every name is checked first, so a typo is an
  error even where the backend could not have run anyway;
- else, with a tuning table (``tuned``: ``{"op/dtype/shape key": [backend, ...]}``, fastest
  first, from ``kohakumoss.kernels.tuning``): a ``TunedOp`` that buckets each call's shape,
  looks its entry up and calls the fastest backend that takes the shape (the reference
  last); one that raises is a ``dispatch.BackendFailed`` naming the knob that leaves it out;
- else the reference.

The dispatch is logged once per distinct ``(device, dtype, dispatch)``. ``docs/engines.md``
says how to add a backend.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from kohakumoss.kernels.dispatch import (REFERENCE_NAME, REFERENCES, Backend, ChosenOp, Fits,  # noqa: F401
                                        KernelError, TunedOp, entry, parse_entry_key)
from kohakumoss.kernels.problems import PROBLEMS
from kohakumoss.model.ops import REFERENCE, OpEntry, OpTable

log = logging.getLogger(__name__)

Choices = Mapping[str, str | Sequence[str]]
Tuned = Mapping[str, Sequence[str]]  # "op/dtype/shape key" -> backend names, fastest first


EXPERIMENTAL = "kohakumoss.experimental"
"""Where opt-in backends live (``kohakumoss/experimental/<name>/``): loaded by name only."""


class KernelRegistry:
    def __init__(self, loads_experimental: bool = False):
        self._backends: dict[str, dict[str, Backend]] = {op: {} for op in REFERENCES}
        self._logged: set[tuple] = set()
        self.loads_experimental = loads_experimental  # the process's registry (``KERNELS``)
        self._tried: set[str] = set()

    def load_experimental(self, names: Iterable[str]) -> list[str]:
        """Import ``kohakumoss.experimental.<name>`` for each backend name no op has and that
        room holds (it registers its backends), once per name; returns those loaded. Only
        the process's registry loads (``loads_experimental``); the core never imports the
        room otherwise."""
        loaded = []
        for name in names:
            if not self.loads_experimental or name in self._tried or not name.isidentifier() \
                    or any(name in b for b in self._backends.values()):
                continue
            self._tried.add(name)
            if importlib.util.find_spec(f"{EXPERIMENTAL}.{name}") is not None:
                importlib.import_module(f"{EXPERIMENTAL}.{name}")
                self.note(("experimental", name), f"kernels: experimental backend {name} loaded "
                          f"({EXPERIMENTAL}.{name})")
                loaded.append(name)
        return loaded

    def _op(self, op: str) -> dict[str, Backend]:
        if op not in self._backends:
            raise KernelError(f"unknown op {op!r}; the op tables have {', '.join(self._backends)}")
        return self._backends[op]

    def register(self, op: str, name: str, fn: Callable,
                 available: Callable[[torch.device, torch.dtype], bool],
                 fits: Fits | None = None, keeps_inputs_only: bool = False,
                 opt_in: Callable[[torch.device], bool] | None = None,
                 forms: Mapping[str, Callable] | None = None) -> Backend:
        """Add backend ``name`` of ``op``: ``fn`` has the reference's signature and results;
        ``available(device, dtype)`` says whether it can run there; ``fits(dims)`` whether it
        takes a problem shape (``kohakumoss.kernels.problems``; None: any);
        ``keeps_inputs_only``: its autograd saves only the op's inputs (the memory engines
        read it from the table's entry); ``opt_in(device)``: there the tuner times it only
        when named (``eligible``); ``forms``: its other forms (``model.ops.FORMS``)."""
        backends = self._op(op)
        if name == REFERENCE_NAME or name in backends:
            raise KernelError(f"op {op!r} already has a backend named {name!r}; pick another name")
        backends[name] = Backend(op, name, fn, available, fits, keeps_inputs_only, opt_in,
                                 dict(forms or {}))
        return backends[name]

    def add_contract(self, contract: Mapping[str, Callable]) -> None:
        """Serve the ops of ``contract`` too (see ``register_contract``)."""
        for op in contract:
            self._backends.setdefault(op, {})

    def unregister(self, op: str, name: str) -> None:
        self.backend(op, name)
        del self._backends[op][name]

    def names(self, op: str) -> list[str]:
        """``reference`` and the registered backends of ``op``."""
        return [REFERENCE_NAME, *self._op(op)]

    def backend(self, op: str, name: str) -> Backend:
        backends = self._op(op)
        if name not in backends and self.load_experimental([name]):
            backends = self._op(op)
        if name not in backends:
            raise KernelError(f"op {op!r} has no backend {name!r}; it has "
                              f"{', '.join(self.names(op))}")
        return backends[name]

    def eligible(self, op: str, device: torch.device | str, dtype: torch.dtype,
                 allow: Sequence[str] | None = None) -> list[Backend]:
        """The backends of ``op`` that can run on ``(device, dtype)``, in registration order:
        those in ``allow`` when given, else all but those that are ``opt_in`` there."""
        device = torch.device(device)
        if allow is not None:
            self.load_experimental(allow)
        return [b for b in self._op(op).values()
                if (b.name in allow if allow is not None else not (b.opt_in and b.opt_in(device)))
                and b.available(device, dtype)]

    def note(self, key: tuple, message: str, level: int = logging.INFO) -> None:
        """Log ``message`` once per ``key`` for this registry."""
        if key not in self._logged:
            self._logged.add(key)
            log.log(level, "%s", message)

    def dispatch(self, device: torch.device | str, dtype: torch.dtype,
                 choices: Choices | None = None, contract: Mapping[str, Callable] = REFERENCE
                 ) -> tuple[dict[str, str], dict[str, list[str]]]:
        """``({op: backend name}, {op: chosen backends that cannot run here})`` for the ops of
        ``contract`` (choices of another contract's ops are checked, not dispatched)."""
        device = torch.device(device)
        wanted = {op: [names] if isinstance(names, str) else list(names)
                  for op, names in (choices or {}).items()}
        for op, names in wanted.items():
            for name in names:
                if name != REFERENCE_NAME:
                    self.backend(op, name)
        chosen, unable = {}, {}
        for op in contract:
            chosen[op] = REFERENCE_NAME
            for name in wanted.get(op, []):
                if name == REFERENCE_NAME or self.backend(op, name).available(device, dtype):
                    chosen[op] = name
                    break
                unable.setdefault(op, []).append(name)
        return chosen, unable

    def chosen_op(self, op: str, device: torch.device, dtype: torch.dtype,
                  names: str | Sequence[str]) -> OpEntry:
        """The table entry of a ``ChosenOp`` over the named backends of ``op`` that can run
        here, in order (up to the reference, when named)."""
        names = [names] if isinstance(names, str) else list(names)
        if REFERENCE_NAME in names:
            names = names[:names.index(REFERENCE_NAME)]
        backends = [self.backend(op, n) for n in names]
        return entry(ChosenOp(op, [b for b in backends if b.available(device, dtype)], self.note))

    def tuned_op(self, op: str, device: torch.device | str, tuned: Tuned) -> TunedOp | None:
        """A ``TunedOp`` for ``op`` from the table's entries, or None when no entry names a
        backend (other than the reference) that can run here."""
        device = torch.device(device)
        chains: dict[tuple[torch.dtype, str], list[Backend]] = {}
        for text, names in tuned.items():
            parsed = parse_entry_key(text)
            if parsed is None or parsed[0] != op:
                continue
            _, dtype, key = parsed
            chain = chains.setdefault((dtype, key), [])
            for name in names:
                if name == REFERENCE_NAME:
                    break  # what follows is slower than the reference
                if name not in self._op(op):
                    self.load_experimental([name])
                b = self._op(op).get(name)
                if b is None or not b.available(device, dtype):
                    self.note(("unusable", op, name, str(device), dtype),
                              f"{op}: the tuning table names backend {name}, which "
                              f"{'is not registered' if b is None else 'cannot run'} here; "
                              f"the next choice runs")
                    continue
                chain.append(b)
        if op not in PROBLEMS or not any(chains.values()):
            return None
        return TunedOp(op, PROBLEMS[op], chains, self.note)

    def build_op_table(self, device: torch.device | str, dtype: torch.dtype,
                       choices: Choices | None = None, tuned: Tuned | None = None,
                       contract: Mapping[str, Callable] = REFERENCE) -> OpTable:
        """A new table of ``contract``'s ops (the DiT's; or the objective's,
        ``diffusion.objective.OBJECTIVE``) for one model computing in ``dtype`` on ``device``."""
        device = torch.device(device)
        chosen, unable = self.dispatch(device, dtype, choices, contract)
        table = OpTable(contract)
        picked = []
        for op, name in chosen.items():
            if name != REFERENCE_NAME:
                table.override(op, self.chosen_op(op, device, dtype, choices[op]))
                picked.append(f"{op}={name}")
            elif tuned and op not in (choices or {}):
                t = self.tuned_op(op, device, tuned)
                if t is not None:
                    table.override(op, entry(t))
                    picked.append(_tuned_summary(t))
        notes = [f"{op}: {', '.join(names)} cannot run here" for op, names in unable.items()]
        key = (tuple(contract), str(device), dtype, tuple(picked), tuple(notes))
        what = "" if contract is REFERENCE else f" ({', '.join(contract)})"
        self.note(key, "kernels%s on %s/%s: %s%s" % (
            what, device, str(dtype).removeprefix("torch."),
            ", ".join(picked) + ", the rest reference" if picked else "every op reference",
            f" ({'; '.join(notes)})" if notes else ""))
        return table


def _tuned_summary(t: TunedOp) -> str:
    """``situ=compile on 2/3 shapes``: each winner other than the reference, on how many of
    the op's table entries (the others run the reference)."""
    wins: dict[str, int] = {}
    for chain in t.chains.values():
        if chain:
            wins[chain[0].name] = wins.get(chain[0].name, 0) + 1
    total = len(t.chains)
    return f"{t.op}=" + ", ".join(f"{n} on {k}/{total} shapes" for n, k in
                                  sorted(wins.items(), key=lambda kv: (-kv[1], kv[0])))


KERNELS = KernelRegistry(loads_experimental=True)
"""The process's registry: backends register here when their module is imported."""


def register_contract(contract: Mapping[str, Callable]) -> None:
    """Make the ops of ``contract`` (name -> reference) ones backends may replace and tables
    be built of (``build_op_table(..., contract=...)``): a package above ``kernels/`` that
    owns ops of its own (``quant/``) calls it when imported. A name another contract has
    already is an error unless it is the same reference."""
    for op, fn in contract.items():
        if REFERENCES.get(op, fn) is not fn:
            raise KernelError(f"op {op!r} is another contract's already; pick another name")
    REFERENCES.update(contract)
    KERNELS.add_contract(contract)


def register_backend(op: str, name: str, fn: Callable,
                     available: Callable[[torch.device, torch.dtype], bool],
                     fits: Fits | None = None, keeps_inputs_only: bool = False,
                     opt_in: Callable[[torch.device], bool] | None = None,
                     forms: Mapping[str, Callable] | None = None) -> Backend:
    return KERNELS.register(op, name, fn, available, fits, keeps_inputs_only, opt_in, forms)


def build_op_table(device: torch.device | str, dtype: torch.dtype,
                   choices: Choices | None = None, tuned: Tuned | None = None,
                   contract: Mapping[str, Callable] = REFERENCE) -> OpTable:
    return KERNELS.build_op_table(device, dtype, choices, tuned, contract)
