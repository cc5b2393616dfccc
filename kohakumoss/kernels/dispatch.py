"""How one model's table dispatches a call (``registry.build_op_table`` makes the ops):
the backends an op may run (``Backend``: where each can run and which shapes it takes), a
tuned op choosing by ``(dtype, shape bucket)`` (``TunedOp``) or a static choice
(``ChosenOp``). What may run is decided when the table is built (a backend that cannot run
on the device or in the dtype is left out there, and the table logs it; ``fits`` passes a
backend over for a shape it does not take). A backend that raises at run time, in a call
or in one of its forms (``Backend.forms``: the norm's ``stream`` and ``added``), is a
``BackendFailed`` naming the op, the backend and the knob that leaves it out
(``kernels.backends``), never a silent fall-back for the rest of the run. A form that
declines (returns None) runs the plain calls. ``entry(op)`` makes either an ``OpEntry`` of the
table (its forms, what it keeps, its per-call choice).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
from collections.abc import Callable, Mapping

import torch
import torch.utils.checkpoint

from kohakumoss.kernels.problems import PROBLEMS, Dims, Problem, call_dtype
from kohakumoss.errors import KohakuError
from kohakumoss.diffusion.objective import OBJECTIVE
from kohakumoss.model.ops import FORMS, REFERENCE, OpEntry

REFERENCE_NAME = "reference"

REFERENCES: dict[str, Callable] = {**REFERENCE, **OBJECTIVE}
"""Every op a backend may replace, with its reference: the DiT's (``model.ops.REFERENCE``),
the objective's (``diffusion.objective.OBJECTIVE``) and those a package above registers
(``registry.register_contract``: the quantized base's, ``quant.ops.QUANT``), each contract a
table of its own."""

Fits = Callable[[Mapping[str, int]], bool]


@dataclasses.dataclass(frozen=True)
class Backend:
    op: str
    name: str
    fn: Callable
    available: Callable[[torch.device, torch.dtype], bool]  # can it run on (device, dtype)?
    fits: Fits | None = None  # does it take this problem shape? None: any shape
    # its autograd keeps only the op's inputs (a fused backward recomputes the rest), so the
    # memory engines' recomputation (kohakumoss.memory.recompute) leaves it alone
    keeps_inputs_only: bool = False
    # devices where the tuner times it only when ``kernels.backends`` names it (a backend
    # whose first build is slow, where others cover the op); None: timed everywhere
    opt_in: Callable[[torch.device], bool] | None = None
    # its other forms (``model.ops.FORMS``: form -> callable on the op's arguments first)
    forms: Mapping[str, Callable] = dataclasses.field(default_factory=dict)

    def takes(self, dims: Mapping[str, int]) -> bool:
        return self.fits is None or bool(self.fits(dims))

    def entry(self) -> OpEntry:
        """This backend alone as a table entry (its forms, what it keeps), for any shape."""
        return OpEntry(self.fn, f"{self.name}.{self.op}", self.forms, self.keeps_inputs_only)


def entry_key(op: str, dtype: torch.dtype, key: str) -> str:
    """The tuning table's key of one (op, dtype, shape bucket): ``situ/bfloat16/N=1024,F=128``."""
    return f"{op}/{str(dtype).removeprefix('torch.')}/{key}"


def parse_entry_key(text: str) -> tuple[str, torch.dtype, str] | None:
    op, _, rest = text.partition("/")
    name, _, key = rest.partition("/")
    dtype = getattr(torch, name, None)
    return (op, dtype, key) if isinstance(dtype, torch.dtype) and key else None


def _key_dims(key: str) -> dict[str, int]:
    """``N=64,F=8`` -> ``{"N": 64, "F": 8}``."""
    return {k: int(v) for k, _, v in (part.partition("=") for part in key.split(",")) if v}


def failure_reason(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first[:200]}" if first else type(e).__name__


class KernelError(KohakuError):
    """An unknown op or backend name, a backend name taken twice, or a backend that failed."""


class BackendFailed(KernelError):
    """A backend raised at run time: the run stops, naming it and how to leave it out."""

    def __init__(self, op: str, backend: str, error: BaseException, form: str | None = None):
        self.op, self.backend, self.reason = op, backend, failure_reason(error)
        what = f"the {form} form of backend {backend}" if form else f"backend {backend}"
        super().__init__(
            f"{op}: {what} failed at run time ({self.reason}); leave it out with "
            f"kernels.backends (the backends to use, without {backend}), or set "
            f"kernels.table: off to run every op's reference")


class TunedOp:
    """One op of one model's table, dispatching each call by ``(dtype, shape bucket)``.

    ``chains[(dtype, key)]`` holds the backends to try, fastest first (the reference is
    always the last resort). A backend that raises is a ``BackendFailed``. A call whose shape has no entry follows the entry of the nearest
    measured shape (same dtype and model sizes, token counts nearest in ratio): a sampler or
    a preview then runs the kernels training measured; with none such it runs the reference.
    Either is logged once per key.
    """

    def __init__(self, op: str, problem: Problem, chains: dict[tuple[torch.dtype, str], list[Backend]],
                 note: Callable[..., None]):
        self.op, self.problem, self.chains, self._note = op, problem, chains, note
        self._resolved: dict[tuple[torch.dtype, str], list[Backend] | None] = {}
        self.reference = REFERENCES[op]
        self.arity = len(inspect.signature(self.reference).parameters)  # a form's first args
        names = sorted({b.name for chain in chains.values() for b in chain})
        self.__qualname__ = f"tuned({op}: {', '.join([*names, REFERENCE_NAME])})"

    def chain(self, dtype: torch.dtype, key: str) -> list[Backend] | None:
        """The backends for ``(dtype, key)``: its entry's, else the nearest measured
        shape's (remembered, said once), else None (the reference)."""
        if (dtype, key) in self.chains:
            return self.chains[(dtype, key)]
        if (dtype, key) in self._resolved:
            return self._resolved[(dtype, key)]
        want = _key_dims(key)
        fixed = [k for k in self.problem.keyed if k not in self.problem.tokens]
        near = [(sum(abs(math.log(max(have[k], 1) / max(want[k], 1))) for k in self.problem.tokens
                     if k in want and k in have), other)
                for (dt, other) in self.chains if dt == dtype
                for have in [_key_dims(other)] if all(have.get(k) == want.get(k) for k in fixed)]
        if not near:
            self._note(("untuned", self.op, dtype, key),
                       f"{self.op}: the tuning table has no entry for {entry_key(self.op, dtype, key)}"
                       f" nor a shape like it; it runs the reference")
            self._resolved[(dtype, key)] = None
            return None
        _, other = min(near)
        self._note(("nearest", self.op, dtype, key),
                   f"{self.op}: the tuning table has no entry for {entry_key(self.op, dtype, key)}; "
                   f"it follows the one measured for {other}")
        self._resolved[(dtype, key)] = self.chains[(dtype, other)]
        return self._resolved[(dtype, key)]

    def backend_for(self, *args) -> str:
        """The backend a call with these arguments runs."""
        dims = self.problem.dims(*args)
        for b in self.chain(call_dtype(args), self.problem.key(dims)) or []:
            if b.takes(dims):
                return b.name
        return REFERENCE_NAME

    def keeps_inputs_only_for(self, *args) -> bool:
        """Whether the backend a call with these arguments runs keeps only its inputs for
        backward (``kohakumoss.memory.recompute`` then runs the call as it is)."""
        name = self.backend_for(*args)
        return name != REFERENCE_NAME and self._named(name).keeps_inputs_only

    def _named(self, name: str) -> Backend:
        return next(b for chain in self.chains.values() for b in chain if b.name == name)

    def stream(self, *args):
        """The call's ``stream`` form (``model.ops.stream_norm``), or None (see ``_form``)."""
        name = self.backend_for(*args)
        return None if name == REFERENCE_NAME else _form(self, self._named(name), "stream", args)

    def added(self, *args):
        """The call's ``added`` form (``model.ops.added_norm``), or None (see ``_form``)."""
        name = self.backend_for(*args[:self.arity])
        return None if name == REFERENCE_NAME else _form(self, self._named(name), "added", args)

    def __call__(self, *args):
        dims = self.problem.dims(*args)
        chain = self.chain(call_dtype(args), self.problem.key(dims))
        if chain is None:
            return self.reference(*args)
        return _run_first(self, chain, dims, args)


class ChosenOp:
    """A static choice (``kernels.backends`` named per op, ``bench --kernels``): the chosen
    backends that can run on the device, in order, then the reference. Each call takes the
    first that takes its shape (``fits``; a backend without one takes any); a backend that
    raises is a ``BackendFailed``."""

    def __init__(self, op: str, backends: list[Backend], note: Callable[..., None]):
        self.op, self.backends, self._note = op, backends, note
        self.problem = PROBLEMS.get(op)
        self.shaped = self.problem is not None and any(b.fits is not None for b in backends)
        self.reference = REFERENCES[op]
        self.arity = len(inspect.signature(self.reference).parameters)  # a form's first args
        # every call that does not fail keeps only its inputs
        self.keeps_inputs_only = all(b.keeps_inputs_only for b in backends) and not self.shaped
        self.__qualname__ = f"chosen({op}: {', '.join([*(b.name for b in backends), REFERENCE_NAME])})"

    def _usable(self, args) -> list[Backend]:
        dims = self.problem.dims(*args) if self.shaped else None
        return [b for b in self.backends
                if dims is None or b.takes(dims)]

    def backend_for(self, *args) -> str:
        usable = self._usable(args)
        return usable[0].name if usable else REFERENCE_NAME

    def keeps_inputs_only_for(self, *args) -> bool:
        usable = self._usable(args)
        return bool(usable) and usable[0].keeps_inputs_only

    def stream(self, *args):
        """The call's ``stream`` form (``model.ops.stream_norm``), or None (see ``_form``)."""
        usable = self._usable(args)
        return _form(self, usable[0], "stream", args) if usable else None

    def added(self, *args):
        """The call's ``added`` form (``model.ops.added_norm``), or None (see ``_form``)."""
        usable = self._usable(args[:self.arity])
        return _form(self, usable[0], "added", args) if usable else None

    def __call__(self, *args):
        return _run_first(self, self.backends, self.problem.dims(*args) if self.shaped else None, args)


# non-reentrant checkpointing stops a recomputation early by raising this from inside the op
# that saves the last tensor it needs; it must pass through (taken for a failure, the next
# backend would run the op again and checkpointing refuses the second save)
_StopRecomputation = getattr(torch.utils.checkpoint, "_StopRecomputationError", ())


def _form(op: TunedOp | ChosenOp, backend: Backend, name: str, args: tuple):
    """``backend``'s form ``name`` of the op (``Backend.forms``:
    ``stream``, the norm of a block's half that also returns x, summing x's two gradients in
    its backward; ``added``, the norm that first makes the previous half's closing add) run on
    ``args``; None where it has none or declines. One that raises is a ``BackendFailed``."""
    form = backend.forms.get(name)
    if form is None:
        return None
    try:
        return form(*args)
    except (torch.OutOfMemoryError, _StopRecomputation):
        raise
    except Exception as e:
        raise BackendFailed(op.op, backend.name, e, form=name) from e


def _run_first(op: TunedOp | ChosenOp, backends: list[Backend], dims: Dims | None, args: tuple):
    """The first of ``backends`` that takes ``dims`` (None: any shape) runs ``args``; the
    reference when none does. One that raises is a ``BackendFailed`` (out of memory and
    checkpointing's early stop pass through as they are)."""
    for b in backends:
        if dims is not None and not b.takes(dims):
            continue
        try:
            return b.fn(*args)
        except (torch.OutOfMemoryError, _StopRecomputation):
            raise  # out of memory is not the backend's fault; checkpointing's early stop passes
        except Exception as e:
            raise BackendFailed(op.op, b.name, e) from e
    return op.reference(*args)


def entry(op: TunedOp | ChosenOp) -> OpEntry:
    """``op`` as a table entry: the forms its backends have (asked per call), what its calls
    keep for backward, the backend each call picks."""
    backends = op.backends if isinstance(op, ChosenOp) else [b for c in op.chains.values() for b in c]
    forms = {name: getattr(op, name) for name in FORMS if any(name in b.forms for b in backends)}
    keeps = True if getattr(op, "keeps_inputs_only", False) else op.keeps_inputs_only_for
    return OpEntry(op, op.__qualname__, forms, keeps, op.backend_for)
