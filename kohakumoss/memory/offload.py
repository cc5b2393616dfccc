"""Activation offload: block checkpointing whose kept inputs wait in host memory
(``docs/memory.md, "Activation offload"``).

``apply_activation_offload(model, device)`` checkpoints every repeated block as ``block``
checkpointing does (forward keeps only the block's input, backward runs the block again),
but the input it keeps goes to page-locked host memory on a side stream as soon as the
block has read it, and comes back in backward one block ahead of its use: while block i
recomputes and backpropagates, block i-1's input is already on its way. The device holds
the inputs of at most the two blocks around the one backward is in, instead of every
block's. With ``halves`` the same is done per half block (as ``sub-block`` checkpointing),
so backward holds half a block's intermediates at a time.

The checkpoint is reentrant style: forward runs the block without grad; backward
recomputes it with grad under the forward's RNG state (adapter dropout draws the same
masks) and backpropagates through it, gradients flowing into the trained tensors as
autograd would. Outputs and gradients are those of plain autograd, bit for bit. It works
under weight streaming (the recomputed block loads itself).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from kohakumoss.memory.checkpointing import repeated_blocks
from kohakumoss.device import indexed
from kohakumoss.memory.replay import KeptAttention, unevaluated
from kohakumoss.model.dit import HALVES, MOSSImageTransformer
from kohakumoss.model.engines import EngineRegistry, Handle

ENGINE = "activation offload"


@dataclasses.dataclass
class _Kept:
    host: list[torch.Tensor]  # the host copies: the part's input, then what it kept besides
    device: list  # the same places: what stays on the device (None where the host has it)
    ready: torch.cuda.Event | None = None  # the copies to the host are done
    back: list[torch.Tensor] | None = None  # on the device again (prefetched)
    arrived: torch.cuda.Event | None = None
    added: list = dataclasses.field(default_factory=list)  # (how many tensors, meta) per ``add``


class Offloader:
    """The host copies of the checkpointed parts' inputs of one forward, in forward order,
    and beside each what its recomputation need not compute again (``memory.replay``)."""

    SMALL = 1 << 20  # bytes: a kept tensor this small stays on the device
    # parts whose copies to the host may be under way: forward waits for the oldest beyond
    # (its device memory is freed only once the copy is done; 0: no bound)
    IN_FLIGHT = 2

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.kept: list[_Kept] = []
        self.bytes = 0  # host bytes of the last forward (a benchmark reads it)
        # the part running: (its entry, None) in forward, (its entry, what it kept besides
        # its input: a list of (tensors, meta) per ``add``) in the recomputation; None outside
        self.part: tuple[int, list | None] | None = None

    def start_forward(self) -> None:
        self.kept, self.bytes = [], 0

    @contextlib.contextmanager
    def running(self):
        """Around each forward of the model (its engine handle's ``forward``)."""
        self.start_forward()
        yield

    def _to_host(self, entry: _Kept, tensors: list[torch.Tensor]) -> None:
        big = [t for t in tensors if t.numel() * t.element_size() >= self.SMALL or not self.cuda]
        # in the same strides where dense (preserve_format): a kernel's backward may take its
        # saved output's layout as given
        hosts = [torch.empty_like(t, device="cpu", pin_memory=self.cuda) for t in big]
        if self.cuda and big:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                for h, t in zip(hosts, big):
                    h.copy_(t, non_blocking=True)
                entry.ready = self.stream.record_event()
            for t in big:  # its memory is not reused before the copy is done
                t.record_stream(self.stream)
        else:
            for h, t in zip(hosts, big):
                h.copy_(t)
        on_host = {id(t): h for t, h in zip(big, hosts)}
        entry.host += [on_host.get(id(t)) for t in tensors]
        entry.device += [None if id(t) in on_host else t for t in tensors]
        self.bytes += sum(h.numel() * h.element_size() for h in hosts)

    def keep(self, x: torch.Tensor) -> int:
        entry = _Kept([], [])
        self._to_host(entry, [x])
        self.kept.append(entry)
        back = len(self.kept) - 1 - self.IN_FLIGHT
        if self.IN_FLIGHT and back >= 0 and self.kept[back].ready is not None:
            self.kept[back].ready.synchronize()
        return len(self.kept) - 1

    def add(self, i: int, tensors: list[torch.Tensor], meta=None) -> None:
        """Part ``i`` keeps ``tensors`` too (to the host beside its input, or on the device
        if small), with ``meta`` (how to read them); ``fetch(i)`` returns both."""
        self._to_host(self.kept[i], list(tensors))
        self.kept[i].added.append((len(tensors), meta))

    def _bring(self, i: int) -> None:
        entry = self.kept[i]
        if entry.back is not None:
            return
        if not self.cuda:
            entry.back = [h.clone() if h is not None else d for h, d in zip(entry.host, entry.device)]
            return
        back = [torch.empty_like(h, device=self.device) if h is not None else d
                for h, d in zip(entry.host, entry.device)]
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            if entry.ready is not None:
                self.stream.wait_event(entry.ready)
            for h, b in zip(entry.host, back):
                if h is not None:
                    b.copy_(h, non_blocking=True)
            entry.arrived = self.stream.record_event()
        for h, b in zip(entry.host, back):
            if h is not None:
                b.record_stream(self.stream)
        entry.back = back

    def fetch(self, i: int) -> tuple[torch.Tensor, list[tuple[list[torch.Tensor], object]]]:
        """Part ``i``'s input and what it kept besides (``(tensors, meta)`` per ``add``), on
        the device (waiting for their copy), part ``i - 1``'s prefetched; the entry is
        released."""
        self._bring(i)
        entry = self.kept[i]
        if entry.arrived is not None:
            torch.cuda.current_stream(self.device).wait_event(entry.arrived)
        back, groups, at = entry.back, [], 1
        for n, meta in entry.added:
            groups.append((back[at:at + n], meta))
            at += n
        if i > 0:
            self._bring(i - 1)
        self.kept[i] = _Kept([], [])
        return back[0], groups


def _autocast_state(device_type: str) -> dict[str, tuple[bool, torch.dtype, bool]]:
    """Autocast as forward runs it, on the device and the CPU: the recomputation in backward
    runs under the same (backward itself runs outside the forward's autocast region)."""
    cache = torch.is_autocast_cache_enabled()
    return {kind: (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind), cache)
            for kind in dict.fromkeys((device_type, "cpu"))}


class _OffloadedBlock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call, offloader, trains, tail, x, *tensors):  # tail: (module, registry) or None
        ctx.call, ctx.offloader, ctx.trains, ctx.tail = call, offloader, trains, tail
        ctx.index = offloader.keep(x)
        ctx.autocast = _autocast_state(offloader.device.type)
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(offloader.device) if offloader.cuda else None
        ctx.save_for_backward(*tensors)
        offloader.part = (ctx.index, None)
        try:
            with torch.no_grad():
                return call(x, *tensors)
        finally:
            offloader.part = None

    @staticmethod
    def backward(ctx, grad):
        off = ctx.offloader
        x, kept = off.fetch(ctx.index)
        x = x.detach().requires_grad_(ctx.needs_input_grad[4])
        tensors = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        devices = [off.device] if off.cuda else []
        off.part = (ctx.index, kept)
        try:
            with torch.random.fork_rng(devices=devices), torch.enable_grad(), unevaluated(*(ctx.tail or (None,))), \
                    contextlib.ExitStack() as autocast:
                for kind, (enabled, dtype, cache) in ctx.autocast.items():  # as forward ran
                    autocast.enter_context(torch.autocast(kind, dtype, enabled, cache))
                torch.set_rng_state(ctx.cpu_rng)
                if ctx.cuda_rng is not None:
                    torch.cuda.set_rng_state(ctx.cuda_rng, off.device)
                out = ctx.call(x, *tensors)
        finally:
            off.part = None
        if out.requires_grad:
            torch.autograd.backward(out, grad)
        else:  # nothing in the block trains: its later forwards skip this backward
            ctx.trains[0] = False
        return (None, None, None, None, x.grad if x.requires_grad else None,
                *[t.grad if t.requires_grad else None for t in tensors])


def offloaded(forward: Callable, offloader: Offloader, tail: torch.nn.Module | None = None,
              engines: EngineRegistry | None = None) -> Callable:
    """``forward(x, *rest)`` as an offloaded checkpoint while grad is enabled; ``rest``'s
    tensors (inside tuples and lists too) are autograd inputs, the rest static; ``tail``:
    the part's last linear, left uncomputed by the recomputation where it may be
    (``memory.replay.unevaluated``, which tells ``engines``, the model's registry)."""
    # whether backward must run the block even when no input needs a gradient: tensors
    # trained inside it (an adapter's, which live outside the block's modules) do; the
    # first backward finds out
    trains = [True]

    def run(x, *rest):
        if not torch.is_grad_enabled():
            return forward(x, *rest)
        leaves, spec = tree_flatten(list(rest))
        where = [isinstance(t, torch.Tensor) for t in leaves]
        static = [None if w else t for t, w in zip(leaves, where)]
        tensors = [t for t, w in zip(leaves, where) if w]

        def call(x_, *ts):
            it = iter(ts[:len(tensors)])
            return forward(x_, *tree_unflatten([next(it) if w else s for w, s in zip(where, static)], spec))

        # a leaf that needs a gradient makes autograd call backward for the block
        extra = [torch.empty(0, requires_grad=True)] if trains[0] else []
        # nothing but the input needs a gradient: the tail's output feeds only a residual add
        # whose gradient then reads none of its values (memory.replay.unevaluated)
        free = None if tail is None or any(t.requires_grad for t in tensors) else (tail, engines)
        return _OffloadedBlock.apply(call, offloader, trains, free, x, *tensors, *extra)

    run.checkpointed = forward
    return run


def apply_activation_offload(model: MOSSImageTransformer, device: torch.device | str,
                             halves: bool = False) -> Offloader:
    """Checkpoint every repeated block with its input offloaded to the host (see the
    module), or with ``halves`` each of its halves (``HALVES``: the attention half and the
    MLP half, as ``sub-block`` checkpointing: backward holds half a block's intermediates
    at a time); the attention kernels' outputs wait beside the inputs and each part's tail
    is left out of its recomputation (``memory.replay``). Returns the offloader
    (``model.engines.state("activation offload")``)."""
    device = indexed(device)
    engines = model.engines
    if engines.get(ENGINE) is not None:
        raise ValueError("the model offloads its activations already")
    if any(engines.wrapped_parts(b) for _, b in repeated_blocks(model)):
        raise ValueError("activation offload checkpoints the blocks itself: apply it "
                         "instead of another checkpointing mode, not on top of one")
    offloader = Offloader(device)
    handle = engines.register(Handle(ENGINE, state=offloader, forward=offloader.running))
    parts = HALVES if halves else ("forward",)
    for _, block in repeated_blocks(model):
        for part in parts:
            tail = block.TAILS.get(HALVES[-1] if part == "forward" else part)
            tail = block.get_submodule(tail) if tail else None
            engines.wrap_part(handle, block, part,
                              lambda fn, tail=tail: offloaded(fn, offloader, tail, engines))
    attention = model.ops.varlen_attention
    model.ops.override("varlen_attention", attention.wrap(KeptAttention(attention, offloader), "kept"))
    return offloader
