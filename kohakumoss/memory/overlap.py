"""The host update, overlapped with the next forward (``docs/memory.md, "Overlapped update"``).

``HostUpdate``'s step runs on the CPU between two steps, and the GPU waits for it: the
masters' AdamW over every trained tensor, then their copies back to the device.
``OverlappedUpdate`` moves that work to a worker thread and cuts it in the order the
forward needs the tensors:

- **chunks**: the trained tensors outside the repeated blocks first (embedders, heads,
  modulation: the forward reads them before the first block), then one chunk per block, in
  forward order (``repeated_blocks``). A tensor belongs to a block by its name: the
  model's path (a full finetune's), or the block path as ``renamed`` writes it (an
  adapter's: its LyCORIS name, ``kohakumoss.adapters.inject.lora_name``);
- **the worker** steps each chunk on a view of the optimizer that holds only the chunk's
  tensors (its state shared, its hyperparameters as they were when the step began),
  pushes the chunk's masters to the device on a side stream, records an event and signals
  the chunk ready;
- **gates**: a forward pre-hook on the model waits for the first chunk, one on each block
  for its own. The CPU waits for the chunk's signal, the compute stream for its event, so
  a block never reads a tensor before its update has landed;
- the main thread goes on meanwhile: the scheduler, the metrics, the next batch, the first
  blocks' forward. ``wait()`` joins the worker; the next backward's gradients, a
  checkpoint and a resume wait for it first.

Each chunk's step is the optimizer's own arithmetic on those tensors (AdamW and Muon
update each tensor on its own), so the masters and the optimizer's state are bit-identical
to ``HostUpdate``'s (``tests/test_overlap.py``).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
from torch import nn

from kohakumoss.memory.checkpointing import repeated_blocks
from kohakumoss.memory.host_update import HostUpdate
from kohakumoss.model.engines import Handle

ENGINE = "overlapped update"


def forward_chunks(names: Sequence[str], model: nn.Module, renamed: Callable[[str], str] | None = None
                   ) -> tuple[list[list[int]], list[nn.Module]]:
    """The trained tensors' indices in the order the forward reads them, and the module
    whose forward each chunk gates: ``model`` for the tensors outside the blocks, then each
    block that holds any. A tensor is a block's when its name starts with the block's path
    and a dot, or with ``renamed(path)`` and an underscore."""
    blocks = repeated_blocks(model)
    prefixes = [(path + ".",) + ((renamed(path) + "_",) if renamed else ()) for path, _ in blocks]
    owned: list[list[int]] = [[] for _ in blocks]
    outside: list[int] = []
    for i, name in enumerate(names):
        k = next((k for k, pair in enumerate(prefixes) if name.startswith(pair)), None)
        (outside if k is None else owned[k]).append(i)
    chunks, gates = [outside], [model]
    for (_, block), idx in zip(blocks, owned):
        if idx:
            chunks.append(idx)
            gates.append(block)
    return chunks, gates


def snapshot(optimizer: torch.optim.Optimizer, keep: set[int] | None = None) -> torch.optim.Optimizer:
    """A view of ``optimizer`` that steps its parameters (those whose ``id`` is in ``keep``,
    default all) with its state, but with the group hyperparameters as they are now (a
    scheduler may change the optimizer's own meanwhile) and without its step hooks."""
    view = object.__new__(type(optimizer))
    view.__dict__.update(optimizer.__dict__)
    view.__dict__.pop("step", None)  # an LR scheduler's wrapper of the optimizer's bound step
    view._optimizer_step_pre_hooks, view._optimizer_step_post_hooks = OrderedDict(), OrderedDict()
    parts = getattr(optimizer, "optimizers", None)
    if parts is not None:  # kohakumoss.training.optim.CombinedOptimizer
        view.optimizers = [snapshot(o, keep) for o in parts]
        view._link()
    else:
        groups = [{**g, "params": [p for p in g["params"] if keep is None or id(p) in keep]}
                  for g in optimizer.param_groups]
        view.param_groups = [g for g in groups if g["params"]]
    return view


def _in_parameter_order(optimizer: torch.optim.Optimizer) -> None:
    """The state's entries in the parameters' order, as one whole step makes them (the
    chunks made them in forward order): a checkpoint's optimizer state is the same either
    way."""
    for part in getattr(optimizer, "optimizers", None) or [optimizer]:
        state = part.state
        order = [p for g in part.param_groups for p in g["params"] if p in state]
        if [id(p) for p in state] != [id(p) for p in order]:
            kept = [(p, state.pop(p)) for p in order]
            state.update(kept)


class OverlappedUpdate(HostUpdate):
    def __init__(self, named: Sequence[tuple[str, nn.Parameter]], device: torch.device,
                 model: nn.Module, renamed: Callable[[str], str] | None = None):
        super().__init__(named, device)
        self.chunks, gates = forward_chunks(self.names, model, renamed)
        self.ready = [threading.Event() for _ in self.chunks]
        for r in self.ready:
            r.set()
        self.events: list[torch.cuda.Event | None] = [None] * len(self.chunks)
        self.push_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.worker: threading.Thread | None = None
        self.error: BaseException | None = None
        me = weakref.ref(self)
        self.gates = [g.register_forward_pre_hook(_gate_hook(me, k)) for k, g in enumerate(gates)]
        # the gated blocks' calls must happen (they never run chained)
        model.engines.register(Handle(ENGINE, state=self, blocks=tuple(gates[1:])))

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer steps only through ``step`` (a direct ``optimizer.step()`` would
        leave the device's tensors behind the masters)."""
        def refuse(*_):
            raise RuntimeError("an overlapped host update steps its optimizer itself: call "
                               "update.step(optimizer), not optimizer.step()")
        optimizer.register_step_pre_hook(refuse)

    def step(self, optimizer: torch.optim.Optimizer, after: Callable[[], None] | None = None) -> None:
        """Start the update on the worker and return; ``after`` (the EMA's update) runs there
        once every chunk is stepped. The masters' gradients are dropped as it goes."""
        self.wait()
        views = [snapshot(optimizer, {id(self.masters[i]) for i in chunk}) for chunk in self.chunks]
        optimizer._opt_called = True  # stepped, as far as an LR scheduler's check goes
        released = torch.cuda.current_stream(self.device).record_event() if self.cuda else None
        for r in self.ready:
            r.clear()
        self.worker = threading.Thread(target=self._work, args=(views, optimizer, after, released),
                                       name="kmoss-host-update", daemon=True)
        self.worker.start()

    def _work(self, views, optimizer, after, released) -> None:
        try:
            if self.cuda:  # a new thread starts on device 0: this rank's device instead
                torch.cuda.set_device(self.device)
            self._settle()  # the last step's pushes have read the masters
            if released is not None:  # the device is done with the tensors it overwrites
                self.push_stream.wait_event(released)
            for k, (chunk, view) in enumerate(zip(self.chunks, views)):
                type(view).step(view)
                self._push(k, chunk)
                self.ready[k].set()
            _in_parameter_order(optimizer)
            if after is not None:
                after()
            for m in self.masters:  # the optimizer's zero_grad(set_to_none=True)
                m.grad = None
        except BaseException as e:  # raised again in the main thread, by a gate or wait()
            self.error = e
        finally:
            for r in self.ready:
                r.set()

    @torch.no_grad()
    def _push(self, k: int, chunk: list[int]) -> None:
        if not self.cuda:
            for i in chunk:
                self.params[i].copy_(self.masters[i])
            return
        with torch.cuda.stream(self.push_stream):
            for i in chunk:
                self.params[i].copy_(self.masters[i], non_blocking=True)
            self.events[k] = self.pushed = self.push_stream.record_event()

    def gate(self, k: int) -> None:
        """Before chunk ``k``'s module runs: its tensors updated and on the device."""
        self.ready[k].wait()
        if self.error is not None:
            self.wait()
        if self.cuda and self.events[k] is not None:
            torch.cuda.current_stream(self.device).wait_event(self.events[k])

    def wait(self) -> None:
        """Join the worker; its error, if any, is raised here."""
        if self.worker is not None:
            self.worker.join()
            self.worker = None
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError("the overlapped host update failed") from error

    def finish_backward(self) -> None:
        self.wait()
        super().finish_backward()

    def overlay(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.wait()
        return super().overlay(state)

    def load(self, state: dict[str, torch.Tensor]) -> None:
        self.wait()
        super().load(state)


def _gate_hook(update: weakref.ref, k: int):
    def hook(module, args):
        if (live := update()) is not None and live.worker is not None:
            live.gate(k)
    return hook
