"""The contract between the model and the engines that act on it from outside
(``docs/engines.md#the-contract``).

An engine (checkpointing, activation offload, rebuilt outputs, weight streaming, an adapter,
a compiled block, a capture of intermediates) changes how parts of a model run, never what
they compute. It does so only through the model's registry (``model.engines``), by
registering a ``Handle`` that says what it owns:

- ``blocks``: the repeated blocks whose calls it hooks (their calls must happen: such a
  block runs whole, never ``JointBlock.chained``);
- ``linears``: the linears whose call it hooks or replaces (they are not plain: a table's
  ``linears`` calls them instead of running ``F.linear`` on their weight);
- ``text``: it hooks the text refiner (its output is then not reused between calls);
- ``forward``: a context entered around every forward of the model;
- ``saved``: a pair of saved-tensor hooks (``pack``, ``unpack``) for the forward's
  autograd; the registry chains every engine's into one pair (the first engine's ``pack``
  that returns something other than its tensor wins; each ``unpack`` passes on what it does
  not own), so engines never nest hooks;
- ``undo``: what removes it again.

A block's parts (``Block.PARTS``: the whole block, its halves) are wrapped through
``wrap_part``: the block asks the registry for the callable of each part and the model asks
it whether a block may run chained, which linears are plain and whether the text refiner's
output may be reused. No engine assigns a model's or a block's attributes, and the model
never inspects a module's ``__dict__``, hooks or compiled state (``tests/test_contract.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

# the parts of a repeated block an engine may wrap: the whole block and its two halves
PARTS = ("forward", "attention", "mlp")


@dataclasses.dataclass(eq=False)
class Handle:
    """What one engine applied to a model owns (see the module)."""

    name: str
    state: Any = None  # the engine's own object (a weight ring, an offloader, a rebuilder)
    blocks: tuple[nn.Module, ...] = ()
    linears: tuple[nn.Module, ...] = ()
    text: bool = False
    forward: Callable[[], contextlib.AbstractContextManager] | None = None
    saved: tuple[Callable, Callable] | None = None
    undo: Callable[[], None] | None = None
    parts: list[tuple[nn.Module, str]] = dataclasses.field(default_factory=list)  # wrapped by it


def _chain_pack(packers: list[Callable]) -> Callable:
    def pack(t):
        for p in packers:
            out = p(t)
            if out is not t:
                return out
        return t
    return pack


def _chain_unpack(unpackers: list[Callable]) -> Callable:
    def unpack(saved):
        for u in unpackers:
            saved = u(saved)
        return saved
    return unpack


class EngineRegistry:
    """The engines applied to one model, in the order they were applied."""

    def __init__(self):
        self._handles: list[Handle] = []
        self._parts: dict[nn.Module, dict[str, Callable]] = {}
        self._linears: Counter[int] = Counter()  # id of a linear -> how many engines hook it
        self._blocks: Counter[int] = Counter()

    # -- engines register and leave ------------------------------------------------------
    def register(self, handle: Handle) -> Handle:
        """Add ``handle``; an engine of the same name applied already is an error."""
        if self.get(handle.name) is not None:
            raise ValueError(f"the model has the {handle.name} engine applied already")
        self._handles.append(handle)
        self._count(handle, 1)
        return handle

    def remove(self, handle: Handle) -> None:
        """Take ``handle`` out, running its ``undo`` and unwrapping the parts it wrapped."""
        if handle not in self._handles:
            return
        for block, part in handle.parts:
            self._parts.get(block, {}).pop(part, None)
        handle.parts.clear()
        self._handles.remove(handle)
        self._count(handle, -1)
        if handle.undo is not None:
            handle.undo()

    @contextlib.contextmanager
    def holding(self, handle: Handle) -> Iterator[Handle]:
        """``handle`` registered within the block, removed after it."""
        self.register(handle)
        try:
            yield handle
        finally:
            self.remove(handle)

    def _count(self, handle: Handle, by: int) -> None:
        for counts, modules in ((self._linears, handle.linears), (self._blocks, handle.blocks)):
            for m in modules:
                counts[id(m)] += by
                if counts[id(m)] <= 0:
                    del counts[id(m)]

    def get(self, name: str) -> Handle | None:
        return next((h for h in self._handles if h.name == name), None)

    def state(self, name: str) -> Any:
        """The state of the engine ``name`` (its ring, offloader...), None where not applied."""
        h = self.get(name)
        return None if h is None else h.state

    def names(self) -> list[str]:
        return [h.name for h in self._handles]

    def claim_linears(self, handle: Handle, linears: Iterable[nn.Module]) -> None:
        """``handle`` hooks these linears too (an adapter injected after it registered)."""
        linears = tuple(linears)
        handle.linears = (*handle.linears, *linears)
        if handle in self._handles:
            for m in linears:
                self._linears[id(m)] += 1

    # -- block parts -----------------------------------------------------------------------
    def wrap_part(self, handle: Handle, block: nn.Module, part: str,
                  make: Callable[[Callable], Callable]) -> None:
        """The ``part`` of ``block`` (``PARTS``) runs as ``make(current)`` from now on,
        ``current`` being what it ran so far (its own method, or an earlier engine's wrap)."""
        if part not in PARTS:
            raise ValueError(f"part {part!r}: one of {', '.join(PARTS)}")
        if handle not in self._handles:
            raise ValueError(f"the {handle.name} engine wraps parts only once registered")
        current = self.part(block, part)
        self._parts.setdefault(block, {})[part] = make(current)
        handle.parts.append((block, part))

    def part(self, block: nn.Module, part: str) -> Callable:
        """What ``block``'s ``part`` runs: an engine's wrap, else the block's own method."""
        wrapped = self._parts.get(block)
        if wrapped and part in wrapped:
            return wrapped[part]
        return getattr(block, "run_block" if part == "forward" else part)

    def wrapped_parts(self, block: nn.Module) -> tuple[str, ...]:
        return tuple(self._parts.get(block, {}))

    # -- what the model asks ---------------------------------------------------------------
    def runs_whole(self, block: nn.Module) -> bool:
        """Whether an engine hooks ``block``'s call or wraps one of its parts: then its
        calls must happen as written (it never runs chained)."""
        return id(block) in self._blocks or bool(self._parts.get(block))

    def claims(self, m: nn.Module) -> bool:
        """Whether an engine hooks or replaces the call of linear ``m``."""
        return id(m) in self._linears

    def plain_linear(self, m: nn.Module) -> bool:
        """The one rule: a bias-free ``nn.Linear`` whose call no engine hooks or replaces
        (``claims``), so that running ``F.linear`` on its weight is its call."""
        return type(m) is nn.Linear and m.bias is None and id(m) not in self._linears

    def text_reusable(self) -> bool:
        """The text refiner's output may be kept between calls: no engine hooks the refiner
        or runs around the model's forward."""
        return not any(h.text or h.forward is not None for h in self._handles)

    @contextlib.contextmanager
    def around_forward(self, grad: bool) -> Iterator[None]:
        """Every engine's forward context, in the order applied, and their saved-tensor
        hooks as one pair while autograd records (``grad``)."""
        handles = self._handles
        if not handles:
            yield
            return
        with contextlib.ExitStack() as stack:
            for h in handles:
                if h.forward is not None:
                    stack.enter_context(h.forward())
            saved = [h.saved for h in handles if h.saved is not None]
            if saved and grad:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(
                    _chain_pack([s[0] for s in saved]), _chain_unpack([s[1] for s in saved])))
            yield

    def __repr__(self) -> str:
        return f"EngineRegistry({self.names()})"
