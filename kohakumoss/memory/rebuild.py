"""Rebuilt outputs: the outputs of the cheap elementwise ops (the norms, RoPE, SiTU) are
not kept for backward; whoever saves one gets a recipe instead, and backward runs the op
again on its inputs (``docs/memory.md, "Rebuilt outputs"``).

A LoRA's down product keeps its input (a norm's output) for its gradient; the attention
keeps q and k (RoPE's outputs); the down projection's adapter keeps SiTU's output. Those
ops' own backward keeps their inputs anyway (the Triton kernels and the recomputed
references keep only their inputs), so a recipe costs nothing to keep: at the published
size it drops a third of what a block keeps (the two norm outputs, q, k and the SiTU output:
4 D + F numbers per token) for a few elementwise kernels in backward, and no matmul runs
twice. Nothing else changes: outputs and gradients are bit-identical (the op runs again on
the same inputs, under the same autocast state).

``apply_rebuild(model)`` wraps the ``REBUILT`` entries of the model's op table (whatever
backend the kernel step chose) so each call made while the model's forward records grads
notes its output, and has the forward run under saved-tensor hooks that swap such an
output (or a view of it) for its recipe. Checkpointed parts run under checkpointing's own hooks
and are left to it. The hooks are the engine's ``saved`` pair in the model's registry
(``model/engines.py``), chained there with a weight ring's (``kohakumoss.memory.streaming``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable

import torch

from kohakumoss.model.dit import MOSSImageTransformer
from kohakumoss.model.engines import Handle
from kohakumoss.model.ops import OpEntry

ENGINE = "rebuild"
REBUILT = ("rms_norm", "modulated_rms_norm", "qk_norm_rope", "situ")


@dataclasses.dataclass(frozen=True)
class _Recipe:
    fn: Callable
    args: tuple
    versions: tuple  # each tensor argument's version when the op ran
    autocast: tuple  # (device type, enabled, dtype) when the op ran
    size: tuple
    stride: tuple
    offset: int  # of the saved view, from the output's own storage offset


def _autocast(device: str) -> tuple:
    if device not in ("cuda", "cpu", "xpu", "mps"):  # meta (the estimator): no autocast there
        return device, False, None
    return device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)


def _tensors(args) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]


class Rebuilder:
    """The outputs of the wrapped ops in the current forward, and the hooks that swap them
    for recipes."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.active = False  # the model's forward is running with grad
        self.made: dict[int, tuple] = {}  # output storage -> (ref, its version, fn, args, their versions, autocast)
        self.rebuilt_bytes = 0  # what the last forward did not keep (a benchmark reads it)

    def wrap(self, entry: OpEntry) -> OpEntry:
        fn = entry.fn

        def run(*args):
            out = fn(*args)
            if self.active and isinstance(out, torch.Tensor) and out.requires_grad:
                self.made[out.untyped_storage()._cdata] = (
                    weakref.ref(out), out._version, fn, args, tuple(t._version for t in _tensors(args)),
                    _autocast(out.device.type))
            return out

        return entry.wrap(run, "rebuilt")

    def recipe(self, t: torch.Tensor) -> _Recipe | None:
        """A recipe for saved tensor ``t`` when it is (a view of) a noted output that has
        not changed since; else None."""
        entry = self.made.get(t.untyped_storage()._cdata)
        if entry is None:
            return None
        ref, version, fn, args, versions, autocast = entry
        out = ref()
        if out is None or out._version != version or t.dtype != out.dtype:
            return None
        return _Recipe(fn, args, versions, autocast, tuple(t.shape), t.stride(),
                       t.storage_offset() - out.storage_offset())

    def pack(self, t: torch.Tensor):
        r = self.recipe(t) if self.active else None
        if r is not None:
            self.rebuilt_bytes += t.numel() * t.element_size()
            return r
        return t

    def unpack(self, saved):
        if not isinstance(saved, _Recipe):
            return saved
        tensors = _tensors(saved.args)
        if tuple(t._version for t in tensors) != saved.versions:
            raise RuntimeError("an input of an elementwise op was modified in place after the op "
                               "ran: its output cannot be rebuilt for backward (turn "
                               "memory.rebuild off, or keep the input unchanged)")
        device, enabled, dtype = saved.autocast
        with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled) if dtype \
                else contextlib.nullcontext():
            out = saved.fn(*saved.args)
        return out.as_strided(saved.size, saved.stride, out.storage_offset() + saved.offset)


    @contextlib.contextmanager
    def running(self):
        """Around each forward of the model: while autograd records, the wrapped ops note
        their outputs; they are forgotten after it."""
        if not torch.is_grad_enabled():
            yield
            return
        self.active, self.rebuilt_bytes = True, 0
        try:
            yield
        finally:
            self.active = False
            self.made.clear()


def apply_rebuild(model: MOSSImageTransformer) -> Rebuilder:
    """Rebuild the elementwise ops' outputs in backward instead of keeping them (see the
    module); returns the rebuilder (``model.engines.state("rebuild")``)."""
    if model.engines.get(ENGINE) is not None:
        raise ValueError("the model rebuilds its elementwise outputs already")
    rebuilder = Rebuilder(model)
    for name in REBUILT:
        model.ops.override(name, rebuilder.wrap(getattr(model.ops, name)))
    model.engines.register(Handle(ENGINE, state=rebuilder, forward=rebuilder.running,
                                  saved=(rebuilder.pack, rebuilder.unpack)))
    return rebuilder
