"""Activation offload: block checkpointing whose kept inputs wait in host memory
(``docs/memory.md#activation-offload``).

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

import dataclasses
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from kohakumoss.memory.checkpointing import repeated_blocks
from kohakumoss.model.dit import HALVES


@dataclasses.dataclass
class _Kept:
    host: torch.Tensor  # the block input's host copy
    ready: torch.cuda.Event | None = None  # the copy to the host is done
    back: torch.Tensor | None = None  # on the device again (prefetched)
    arrived: torch.cuda.Event | None = None


class Offloader:
    """The host copies of the blocks' inputs of one forward, in forward order."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.kept: list[_Kept] = []
        self.bytes = 0  # host bytes of the last forward (a benchmark reads it)

    def start_forward(self) -> None:
        self.kept, self.bytes = [], 0

    def keep(self, x: torch.Tensor) -> int:
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=self.cuda)
        entry = _Kept(host)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(x, non_blocking=True)
                entry.ready = self.stream.record_event()
            x.record_stream(self.stream)  # its memory is not reused before the copy is done
        else:
            host.copy_(x)
        self.kept.append(entry)
        self.bytes += host.numel() * host.element_size()
        return len(self.kept) - 1

    def _bring(self, i: int) -> None:
        entry = self.kept[i]
        if entry.back is not None:
            return
        if not self.cuda:
            entry.back = entry.host.clone()
            return
        back = torch.empty(entry.host.shape, dtype=entry.host.dtype, device=self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(entry.ready)
            back.copy_(entry.host, non_blocking=True)
            entry.arrived = self.stream.record_event()
        back.record_stream(self.stream)
        entry.back = back

    def fetch(self, i: int) -> torch.Tensor:
        """Block ``i``'s input on the device (waiting for its copy), block ``i - 1``'s
        prefetched; the entry is released."""
        self._bring(i)
        entry = self.kept[i]
        if entry.arrived is not None:
            torch.cuda.current_stream(self.device).wait_event(entry.arrived)
        x = entry.back
        if i > 0:
            self._bring(i - 1)
        self.kept[i] = dataclasses.replace(entry, back=None, host=entry.host[:0])
        return x


class _OffloadedBlock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call, offloader, trains, x, *tensors):
        ctx.call, ctx.offloader, ctx.trains = call, offloader, trains
        ctx.index = offloader.keep(x)
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(offloader.device) if offloader.cuda else None
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            return call(x, *tensors)

    @staticmethod
    def backward(ctx, grad):
        x = ctx.offloader.fetch(ctx.index).detach().requires_grad_(ctx.needs_input_grad[3])
        tensors = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        devices = [ctx.offloader.device] if ctx.offloader.cuda else []
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, ctx.offloader.device)
            out = ctx.call(x, *tensors)
        if out.requires_grad:
            torch.autograd.backward(out, grad)
        else:  # nothing in the block trains: its later forwards skip this backward
            ctx.trains[0] = False
        return (None, None, None, x.grad if x.requires_grad else None,
                *[t.grad if t.requires_grad else None for t in tensors])


def offloaded(forward: Callable, offloader: Offloader) -> Callable:
    """``forward(x, *rest)`` as an offloaded checkpoint while grad is enabled; ``rest``'s
    tensors (inside tuples and lists too) are autograd inputs, the rest static."""
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
        return _OffloadedBlock.apply(call, offloader, trains, x, *tensors, *extra)

    run.checkpointed = forward
    return run


def apply_activation_offload(model: torch.nn.Module, device: torch.device | str,
                             halves: bool = False) -> Offloader:
    """Checkpoint every repeated block with its input offloaded to the host (see the
    module), or with ``halves`` each of its halves (``HALVES``: the attention half and the
    MLP half, as ``sub-block`` checkpointing: backward holds half a block's intermediates
    at a time); returns the offloader (``model.offloader``)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if getattr(model, "offloader", None) is not None:
        raise ValueError("the model offloads its activations already")
    offloader = Offloader(device)
    parts = HALVES if halves else ("forward",)
    for _, block in repeated_blocks(model):
        if any(hasattr(getattr(block, m), "checkpointed") for m in ("forward", *HALVES)):
            raise ValueError("activation offload checkpoints the blocks itself: apply it "
                             "instead of another checkpointing mode, not on top of one")
        for method in parts:
            setattr(block, method, offloaded(getattr(block, method), offloader))
    inner = model.forward

    def forward(*args, **kwargs):
        offloader.start_forward()
        return inner(*args, **kwargs)

    model.forward = forward
    model.offloader = offloader
    return offloader
