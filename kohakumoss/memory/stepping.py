"""Where a device optimizer's update runs (``docs/memory.md, "The step in backward"`` and
``#streamed-states``): two placements beside the plain step and the host update.

- ``FusedStep`` (``memory.optimizer: fused``): each trained tensor is updated inside the
  step's last backward, the moment its gradient is final
  (``register_post_accumulate_grad_hook``), and its gradient is dropped at once. The device
  holds the gradients backward is still making, not all of them. The update is the
  optimizer's own arithmetic on that one tensor (a view of the optimizer holding only it,
  ``overlap.snapshot``: AdamW and Muon update each tensor on its own), so parameters and
  states are bit-identical to the plain step's. What it cannot do: clip by the global norm,
  unscale fp16 gradients, skip a step with a non-finite gradient, or wait for other ranks'
  gradients; the params refuse those combinations, and a non-finite norm stops the run.
- ``StreamedStates`` (``memory.optimizer: streamed``): the optimizer's states (AdamW's two
  moments) live in page-locked host memory between steps. A step walks the trained tensors
  in order, in groups of up to ``STATE_GROUP_NUMEL`` elements: the next group's states come
  to the device on a side stream while this one updates, and each one's go back to the host
  after its update. The device holds two groups' states at a time; the arithmetic is the
  device optimizer's, bit for bit.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import torch

from kohakumoss.memory.overlap import _in_parameter_order, snapshot
from kohakumoss.device import indexed


class FusedStep:
    def __init__(self, named: Sequence[tuple[str, torch.nn.Parameter]], optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.params = [p for _, p in named]
        self.armed = False  # the step's last backward: gradients are final as they land
        self.stepped: set[int] = set()
        self.squares: torch.Tensor | None = None  # the stepped gradients' squared norms, summed
        me = weakref.ref(self)  # (a parameter's hooks live where the collector cannot see a cycle)
        for p in self.params:
            p.register_post_accumulate_grad_hook(_fused_hook(me))

    def arm(self) -> None:
        """The next backward is the step's last: update each tensor as its gradient lands."""
        self.armed = True

    @torch.no_grad()
    def _step(self, p: torch.Tensor) -> None:
        square = p.grad.detach().float().square().sum()
        self.squares = square if self.squares is None else self.squares + square
        snapshot(self.optimizer, {id(p)}).step()
        p.grad = None
        self.stepped.add(id(p))

    def finish(self) -> tuple[float, bool]:
        """After the step's last backward: a tensor whose gradient did not land armed (the
        last micro-batch had no usable sample) is stepped now; the state is put back in
        parameter order. Returns the gradient norm and whether it is finite."""
        for p in self.params:
            if p.grad is not None and id(p) not in self.stepped:
                self._step(p)
        _in_parameter_order(self.optimizer)
        _noted(self.optimizer)
        norm = float(self.squares.sqrt()) if self.squares is not None else 0.0
        self.squares, self.armed, self.stepped = None, False, set()
        return norm, math.isfinite(norm)


def _noted(optimizer: torch.optim.Optimizer) -> None:
    """Tell torch's LR scheduler the optimizer stepped: the per-tensor views step without the
    wrapper of ``optimizer.step`` that notes it (else the scheduler warns it ran first)."""
    optimizer._opt_called = True


def _fused_hook(step: weakref.ref):
    def hook(p: torch.Tensor) -> None:
        if (live := step()) is not None and live.armed:
            live._step(p)
    return hook


STATE_GROUP_NUMEL = 2**23
"""Trained elements whose states ``StreamedStates`` moves and steps together (AdamW's two
fp32 moments: 64 MiB); the device holds two such groups' states (one prefetched)."""


class StreamedStates:
    def __init__(self, named: Sequence[tuple[str, torch.nn.Parameter]], optimizer: torch.optim.Optimizer,
                 device: torch.device):
        self.optimizer = optimizer
        self.params = [p for _, p in named]
        self.device = indexed(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.host: dict[int, dict[str, torch.Tensor]] = {}  # each tensor's page-locked states
        self.moved: dict[int, set[str]] = {}  # which of its states live on the device
        # each tensor's optimizer (a combined one's part): its ``state`` is looked up at use,
        # as loading a state dict replaces it
        parts = getattr(optimizer, "optimizers", None) or [optimizer]
        self.part = {id(p): part for part in parts for g in part.param_groups for p in g["params"]}
        # a loaded state dict lands on the parameters' device: back to the host
        for part in getattr(optimizer, "optimizers", None) or [optimizer]:
            part.register_load_state_dict_post_hook(lambda _opt: self._all_to_host())

    @staticmethod
    def groups(params: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        """``params`` in order, in runs of at most ``STATE_GROUP_NUMEL`` elements (a wider
        tensor alone): one step and one round of copies per run, not per tensor (504 steps
        of a LoRA's tensors one by one took 0.26 s on the H200)."""
        out: list[list[torch.Tensor]] = []
        size = 0
        for p in params:
            if not out or size + p.numel() > STATE_GROUP_NUMEL:
                out.append([])
                size = 0
            out[-1].append(p)
            size += p.numel()
        return out

    def _state(self, p: torch.Tensor) -> dict:
        return self.part[id(p)].state

    def _bring(self, group: Sequence[torch.Tensor]) -> torch.cuda.Event | None:
        """The states of ``group``'s tensors that live on the host back onto the device, on
        the side stream (none yet: the optimizer makes them on its first step)."""
        if not self.cuda or not any(self.moved.get(id(p)) for p in group):
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for p in group:
            keys, state = self.moved.get(id(p)), self._state(p)
            if not keys:
                continue
            with torch.cuda.stream(self.stream):
                moved = {k: v.to(self.device, non_blocking=True) if k in keys else v
                         for k, v in state[p].items()}
            for k in keys:  # made on the side stream, read on the compute stream
                moved[k].record_stream(torch.cuda.current_stream(self.device))
            state[p] = moved
        return self.stream.record_event()

    def _send(self, p: torch.Tensor) -> None:
        """``p``'s states on the device, just updated, to their host buffers (after the
        update; a state the optimizer keeps on the CPU, AdamW's step count, stays)."""
        state = self._state(p)
        host = self.host.setdefault(id(p), {})
        keys = self.moved.setdefault(id(p), set())
        out = dict(state[p])
        for k, v in state[p].items():
            if not isinstance(v, torch.Tensor) or v.device != self.device:
                continue
            h = host.get(k)
            if h is None or h.shape != v.shape or h.dtype != v.dtype:
                h = host[k] = torch.empty_like(v, device="cpu", pin_memory=self.cuda)
            if self.cuda:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.stream):
                    h.copy_(v, non_blocking=True)
                v.record_stream(self.stream)
            elif h is not v:
                h.copy_(v)
            out[k] = h
            keys.add(k)
        state[p] = out

    @torch.no_grad()
    def step(self) -> None:
        """The optimizer's step, one group of trained tensors at a time (``groups``), their
        states on the device only for their own update."""
        groups = self.groups([p for p in self.params if p.grad is not None])
        ready = self._bring(groups[0]) if groups else None
        for i, group in enumerate(groups):
            if ready is not None:
                torch.cuda.current_stream(self.device).wait_event(ready)
            ready = self._bring(groups[i + 1]) if i + 1 < len(groups) else None
            snapshot(self.optimizer, {id(p) for p in group}).step()
            for p in group:
                self._send(p)
        _in_parameter_order(self.optimizer)
        _noted(self.optimizer)
        if self.cuda:  # the host buffers complete before anything reads them (a checkpoint)
            self.stream.synchronize()

    @torch.no_grad()
    def _all_to_host(self) -> None:
        for p in self.params:
            if p in self._state(p):
                self._send(p)
        if self.cuda:
            self.stream.synchronize()

    def host_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for d in self.host.values() for v in d.values())
