"""Weight streaming: the frozen base's block weights live in (pinned) host memory and pass
through a ring of ``slots`` block-sized buffers on the device (``docs/memory.md, "Weight streaming"``).

``apply_weight_streaming(model, device, slots)`` acts on a built model from outside, as
its ``weight streaming`` engine (``model/engines.py``); ``stream_weights`` does the same for
another model (a text encoder), whose caller runs its forwards in ``ring.running()``:

- every matrix (2-D weight) of the repeated blocks (``REPEATED``) that takes no gradient and
  has the blocks' dtype moves to one host buffer per block (page-locked on CUDA); the rest
  of the model (embedders, head, the blocks' norms and biases) moves to ``device`` and
  stays there;
- a block about to run is copied into a free or least recently used slot, the next blocks
  are prefetched on a side stream (CUDA events order the copy after the slot's last reader
  and the reader after the copy), and its weights point at the slot meanwhile;
- autograd keeps no weight: a saved tensor that lives in a slot is replaced by where it was
  (block, offset, shape, stride) and read back from the ring in backward, which walks the
  blocks in reverse and prefetches the blocks before, so streaming needs no checkpointing
  (and works under every checkpointing mode: a recomputed block loads itself).

Outputs and gradients are bit-identical to the resident model's: the same weights, the same
kernels. The order of the blocks is ``REPEATED``'s, the order the forward runs them; a
forward that skips a block only wastes its prefetch. Each block's weights, while not in a
slot, are their host copies, so ``state_dict`` and reading a weight still work (on the
host); casting or moving the model afterwards is not supported.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from kohakumoss.memory.checkpointing import repeated_blocks
from kohakumoss.memory.host_copies import NodeCopies, OwnCopies
from kohakumoss.device import indexed
from kohakumoss.model.dit import MOSSImageTransformer
from kohakumoss.model.engines import Handle

ENGINE = "weight streaming"

# elements: each weight starts at least 512-byte aligned in its block's buffer, as the
# allocator aligns a resident one (cuBLAS picks its kernels by alignment)
ALIGN = 256


@dataclasses.dataclass(frozen=True)
class _Saved:
    """A saved tensor that lived in a slot: read back from the ring in backward."""

    unit: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def streamed_weights(model: nn.Module, blocks: Sequence[nn.Module] | None = None,
                     trainable: bool = False) -> list[list[tuple[nn.Module, str, nn.Parameter]]]:
    """Per block (``blocks``, default the DiT's repeated ones), in forward order:
    ``(module, name, parameter)`` of the weights streaming moves: the matrices without
    gradient (with ``trainable``, a full finetune's, every matrix) in the blocks' most
    common dtype."""
    units = []
    for block in _blocks(model, blocks):
        units.append([(m, n, p) for m in block.modules() for n, p in m.named_parameters(recurse=False)
                      if p.dim() >= 2 and (trainable or not p.requires_grad)])
    dtypes = Counter(p.dtype for unit in units for _, _, p in unit)
    if not dtypes:
        return [[] for _ in units]
    dtype = dtypes.most_common(1)[0][0]
    return [[w for w in unit if w[2].dtype == dtype] for unit in units]


def _blocks(model: nn.Module, blocks: Sequence[nn.Module] | None) -> list[nn.Module]:
    return [b for _, b in repeated_blocks(model)] if blocks is None else list(blocks)


def unit_numel(unit: list[tuple[nn.Module, str, nn.Parameter]]) -> int:
    """Elements of one block's buffer (each weight aligned)."""
    return sum(_aligned(p.numel()) for _, _, p in unit)


class WeightRing:
    """The host copies, the device slots and which block is in which slot."""

    def __init__(self, units: list[list[tuple[nn.Module, str, nn.Parameter]]],
                 device: torch.device, slots: int, dtype: torch.dtype | None = None,
                 copies: OwnCopies | NodeCopies | None = None):
        if slots < 1:
            raise ValueError(f"weight streaming needs at least one slot, got {slots}")
        self.device = device
        self.cuda = device.type == "cuda"
        self.units = units
        streamed = [p for unit in units for _, _, p in unit]
        self.dtype = dtype or streamed[0].dtype  # the copies' (a full finetune's: compute)
        self.n_slots = min(slots, len(units))
        self.host: list[torch.Tensor] = []
        self.views: list[list[tuple[int, int]]] = []  # per unit: (offset, numel) of each weight
        self.copies = copies or OwnCopies(self.cuda)
        flats, write = self.copies.make([unit_numel(unit) for unit in units], self.dtype)
        for unit, flat in zip(units, flats):
            offsets, at = [], 0
            for _, _, p in unit:
                if write:  # a node's shared copies: its first rank writes them
                    flat[at:at + p.numel()].view(p.shape).copy_(p.data)
                p.data = flat[at:at + p.numel()].view(p.shape)
                offsets.append((at, p.numel()))
                at += _aligned(p.numel())
            self.host.append(flat)
            self.views.append(offsets)
        self.copies.done()
        width = max(h.numel() for h in self.host)
        self.slots = [torch.empty(width, dtype=self.dtype, device=device) for _ in range(self.n_slots)]
        self.slot_by_ptr = {s.untyped_storage().data_ptr(): i for i, s in enumerate(self.slots)}
        self.unit_in: list[int | None] = [None] * self.n_slots
        self.slot_of: dict[int, int] = {}
        self.touched = [0] * self.n_slots
        self.clock = 0
        self.pending: list[torch.cuda.Event | None] = [None] * self.n_slots
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.last, self.direction, self.expect_backward = -1, 1, False
        self.loads = 0  # copies made (a test and a benchmark read it)
        self.hooked: list[nn.Module] = []  # the modules whose pre-hooks load their block

    # -- which blocks are where ----------------------------------------------------------
    def _point(self, u: int, storage: torch.Tensor) -> None:
        for (_, _, p), (at, n) in zip(self.units[u], self.views[u]):
            p.data = storage[at:at + n].view(p.shape)

    def _load(self, u: int, protect: set[int]) -> None:
        """Put block ``u`` in a slot (copying it there) unless it is in one; the slot is an
        empty one or the least recently used whose block is not in ``protect``."""
        self.clock += 1
        if u in self.slot_of:
            self.touched[self.slot_of[u]] = self.clock
            return
        free = [i for i, v in enumerate(self.unit_in) if v is None]
        if not free:
            free = sorted((i for i, v in enumerate(self.unit_in) if v not in protect),
                          key=self.touched.__getitem__)
        if not free:  # every slot holds a block in use (a prefetch that cannot happen now)
            return
        i = free[0]
        old = self.unit_in[i]
        if old is not None:  # its weights are their host copies again
            self._point(old, self.host[old])
            del self.slot_of[old]
        n = self.host[u].numel()
        self._copy(i, u, n)
        self.loads += 1
        self.unit_in[i], self.slot_of[u], self.touched[i] = u, i, self.clock
        self._point(u, self.slots[i])

    def _copy(self, i: int, u: int, n: int) -> None:
        if self.cuda:
            # after every reader of the slot enqueued so far, on the side stream
            released = torch.cuda.current_stream(self.device).record_event()
            self.copy_stream.wait_event(released)
            with torch.cuda.stream(self.copy_stream):
                self.slots[i][:n].copy_(self.host[u], non_blocking=True)
                self.pending[i] = self.copy_stream.record_event()
        else:
            self.slots[i][:n].copy_(self.host[u])

    def _window(self, u: int, d: int) -> list[int]:
        """The blocks to prefetch after ``u`` going in direction ``d``: the next ones, or,
        at the end of a forward that a backward follows, the ones before (and at the start
        of a backward, or the end of an inference forward, the next call's first ones)."""
        last = len(self.units) - 1
        if d > 0 and u == last:
            d = -1 if self.expect_backward else 1
            start = u - 1 if d < 0 else 0
        elif d < 0 and u == 0:
            d, start = 1, 1
        else:
            start = u + d
        out = []
        for k in range(self.n_slots - 1):
            w = start + k * d
            if 0 <= w <= last and w != u:
                out.append(w)
        return out

    def ensure(self, u: int, direction: int | None = None) -> torch.Tensor:
        """Block ``u`` in a slot, the compute stream waiting for its copy, the blocks after it
        (in the walking direction) prefetched; returns its slot."""
        # the ring's copies and views are not ops of the model (selective checkpointing
        # counts those, and a recomputation must run the same ones)
        with _disable_current_modes():
            return self._ensure(u, direction)

    def _ensure(self, u: int, direction: int | None) -> torch.Tensor:
        if direction is None:
            direction = 1 if u > self.last else -1 if u < self.last else self.direction
        self.direction, self.last = direction, u
        if direction > 0 and u == len(self.units) - 1:
            self.expect_backward = torch.is_grad_enabled()
        self._load(u, {u})
        i = self.slot_of[u]
        if self.pending[i] is not None:
            torch.cuda.current_stream(self.device).wait_event(self.pending[i])
            self.pending[i] = None
        window = self._window(u, direction)
        for w in window:
            self._load(w, {u, *window})
        return self.slots[i]

    def start_forward(self) -> None:
        self.last, self.direction = -1, 1

    @contextlib.contextmanager
    def running(self):
        """Around each forward of the streamed model: the walk starts at its first block."""
        self.start_forward()
        yield

    def invalidate(self) -> None:
        """Empty every slot, each weight its host copy again: before the host copies are
        written (a full finetune's update), so no slot keeps an old copy."""
        for i, u in enumerate(self.unit_in):
            if u is not None:
                self._point(u, self.host[u])
                del self.slot_of[u]
            self.unit_in[i], self.pending[i] = None, None

    # -- autograd keeps where a weight was, not the weight ---------------------------------
    def pack(self, t: torch.Tensor):
        if t.device == self.device and t.dtype == self.dtype and t.layout == torch.strided:
            i = self.slot_by_ptr.get(t.untyped_storage().data_ptr())
            if i is not None and self.unit_in[i] is not None:
                return _Saved(self.unit_in[i], t.storage_offset(), tuple(t.shape), t.stride())
        return t

    def unpack(self, saved):
        if isinstance(saved, _Saved):
            return self.ensure(saved.unit, -1).as_strided(saved.size, saved.stride, saved.offset)
        return saved

    def resident_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.slots)

    def host_bytes(self) -> int:
        return sum(h.numel() * h.element_size() for h in self.host)


def stream_weights(model: nn.Module, device: torch.device | str, slots: int,
                   blocks: Sequence[nn.Module] | None = None, trainable: bool = False,
                   dtype: torch.dtype | None = None, resident: int = 0,
                   copies: OwnCopies | NodeCopies | None = None) -> WeightRing:
    """Stream ``model``'s frozen block weights through ``slots`` device buffers; everything
    else moves to ``device`` (see the module). ``blocks``: the blocks in the order the
    forward runs them (default the DiT's repeated blocks; a text encoder's layers). Each
    forward of the model must run inside ``ring.running()`` (``apply_weight_streaming`` has
    the DiT's registry enter it).

    ``trainable`` (a full finetune): every block matrix streams, held in ``dtype`` (the
    compute dtype; its fp32 masters live in ``HostUpdate``, which writes the host copies
    after each step); its gradients reach it as autograd's. ``resident``: the first blocks
    that stay on the device with the rest of the model (fewer copies a step, where memory
    allows). ``copies``: where the host copies live (``host_copies``; default this
    process's own page-locked buffers). Returns the ring."""
    device = indexed(device)
    blocks = _blocks(model, blocks)
    if not 0 <= resident < len(blocks):
        raise ValueError(f"resident blocks {resident}: there are {len(blocks)} blocks, and weight "
                         f"streaming streams at least one (0 <= resident < {len(blocks)})")
    blocks = blocks[resident:]
    units = streamed_weights(model, blocks, trainable)
    if not any(units):
        raise ValueError("weight streaming found no frozen block weights to stream: it streams a "
                         "frozen base under an adapter (a full finetune trains every weight: "
                         "stream it with trainable=True)")
    keep = {id(p) for unit in units for _, _, p in unit}
    ring = WeightRing(units, device, slots, dtype, copies)  # the streamed weights now live on the host
    model._apply(lambda t: t if id(t) in keep else t.to(device))
    for u, (block, unit) in enumerate(zip(blocks, units)):
        hook = _hook(ring, u)
        block.register_forward_pre_hook(hook)
        modules = list({id(m): m for m, _, _ in unit}.values())
        for module in modules:
            module.register_forward_pre_hook(hook)
        ring.hooked += [block, *modules]
    return ring


def apply_weight_streaming(model: MOSSImageTransformer, device: torch.device | str, slots: int,
                           trainable: bool = False, dtype: torch.dtype | None = None,
                           resident: int = 0, copies: OwnCopies | NodeCopies | None = None
                           ) -> WeightRing:
    """``stream_weights`` of the DiT's repeated blocks, registered as its weight streaming
    engine (``model.engines.state("weight streaming")``): the ring runs around each forward,
    its saved-tensor hooks keep where a weight was instead of the weight, and the streamed
    blocks and linears are its (they run whole, never as plain products)."""
    if model.engines.get(ENGINE) is not None:
        raise ValueError("the model streams its weights already")
    ring = stream_weights(model, device, slots, None, trainable, dtype, resident, copies)
    model.engines.register(Handle(
        ENGINE, state=ring, blocks=tuple(m for m in ring.hooked if not isinstance(m, nn.Linear)),
        linears=tuple(m for m in ring.hooked if isinstance(m, nn.Linear)), text=True,
        forward=ring.running, saved=(ring.pack, ring.unpack)))
    return ring


def _hook(ring: WeightRing, u: int) -> Callable:
    def pre_hook(module, args):
        ring.ensure(u)
    return pre_hook
