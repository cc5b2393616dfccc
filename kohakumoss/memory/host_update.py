"""The optimizer on the host: gradients leave the device as backward makes them, and the
update runs on the CPU over host copies of the trained tensors (``docs/memory.md, "The host update"``).

``HostUpdate(named, device)`` acts on the trained parameters from outside:

- each parameter gets a host copy, its **master** (page-locked on CUDA). The optimizer, the
  gradient clipping and the EMA work on the masters (``named_masters``), so their states
  live in host memory and the device holds no optimizer state at all;
- a hook on each parameter (``register_post_accumulate_grad_hook``) copies its gradient to a
  host buffer on a side stream the moment backward has it and drops the device gradient,
  so at most the gradients backward is still making are on the device (gradient offload);
- ``finish_backward()`` (after each micro-batch's backward) waits for those copies and
  accumulates them into the masters' gradients, in fp32 on the host, in micro-batch order;
- after the optimizer's step (a hook on it) the masters are copied back to the parameters;
- a checkpoint holds the masters (``overlay``) and a resume loads them (``load``).

The masters are at least fp32: a full finetune whose block weights stream in the compute
dtype (``apply_weight_streaming(trainable=True)``) keeps its fp32 weights here, and its
bf16 gradients are accumulated into fp32 on the host as autocast's cast would.

The masters and the optimizer's state dict have the same names and order as a device
optimizer's, so a checkpoint resumes under either placement. With the device the CPU the
arithmetic is the device optimizer's exactly; on CUDA it is the CPU's AdamW instead of the
GPU's (fp32 round-off apart).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

from kohakumoss.device import indexed


class HostUpdate:
    def __init__(self, named: Sequence[tuple[str, torch.nn.Parameter]], device: torch.device):
        self.device = indexed(device)  # the overlapped update's worker thread needs the index
        self.cuda = self.device.type == "cuda"
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        pin = self.cuda
        with torch.no_grad():  # at least fp32 (a streamed full finetune holds bf16 copies)
            self.masters = [torch.empty(p.shape, dtype=torch.promote_types(p.dtype, torch.float32),
                                        pin_memory=pin).copy_(p.detach()).requires_grad_(True)
                            for p in self.params]
        # the gradients' landing buffers, in their dtype (made at the first backward)
        self.staging: list[torch.Tensor | None] = [None] * len(self.params)
        # the masters' .grad; page-locked, as a landing buffer of the master's dtype and the
        # gradient trade places (``finish_backward``)
        self.grads = [torch.empty(m.shape, dtype=m.dtype, pin_memory=pin) for m in self.masters]
        self.arrived = [False] * len(self.params)
        self.before_push: list = []  # called before the masters are written back (ring.invalidate)
        self.pushed: torch.cuda.Event | None = None
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        # the hooks reach this object through a weak reference: a parameter's hooks live in
        # autograd's C++ side, where the garbage collector cannot see a cycle back to the
        # parameter (a strong one kept every parameter and gradient alive after the run)
        me = weakref.ref(self)
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(_landing_hook(me, i))
        self.copied = 0  # bytes copied to the host (a benchmark reads it)

    @property
    def named_masters(self) -> list[tuple[str, torch.Tensor]]:
        return list(zip(self.names, self.masters))

    def land(self, i: int, p: torch.Tensor) -> None:
        """Parameter ``i``'s gradient, just accumulated: copied to its landing buffer on the
        side stream, and dropped from the device."""
        grad, p.grad = p.grad, None
        if self.staging[i] is None or self.staging[i].dtype != grad.dtype:
            self.staging[i] = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=self.cuda)
        if self.cuda:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                self.staging[i].copy_(grad, non_blocking=True)
            grad.record_stream(self.copy_stream)  # not reused before the copy is done
        else:
            self.staging[i].copy_(grad)
        self.arrived[i] = True
        self.copied += grad.numel() * grad.element_size()

    @torch.no_grad()
    def finish_backward(self) -> None:
        """Wait for this backward's gradients and add them to the masters' (the first
        micro-batch's taken as they are, later ones added, as autograd accumulates on a
        device).

        A first gradient already in the master's dtype is not copied: its landing buffer
        becomes the master's gradient and the buffer that held the last step's gradient
        takes the next landing (the host's copy of 74M fp32 values is ~20-30 ms the device
        would wait for). The optimizer is done with that buffer by then: a step drops the
        gradients, and an overlapped one has updated a block before its forward, so before
        any of its gradients land again."""
        if self.cuda:
            self.copy_stream.synchronize()
        for i, m in enumerate(self.masters):
            if not self.arrived[i]:
                continue
            if m.grad is not None:
                m.grad.add_(self.staging[i])
            elif self.staging[i].dtype == m.dtype:
                self.grads[i], self.staging[i] = self.staging[i], self.grads[i]
                m.grad = self.grads[i]
            else:  # e.g. bf16 gradients of a streamed full finetune: widened into fp32
                m.grad = self.grads[i].copy_(self.staging[i])
            self.arrived[i] = False

    @torch.no_grad()
    def push(self) -> None:
        """The masters to the parameters (after a step, or a resume that loaded them)."""
        for fn in self.before_push:
            fn()
        for p, m in zip(self.params, self.masters):
            p.copy_(m, non_blocking=self.cuda and p.device.type == "cuda")
        if self.cuda:  # the masters are not written again before these copies have read them
            self.pushed = torch.cuda.current_stream(self.device).record_event()

    def _settle(self) -> None:
        """Wait for the last push's copies (before the masters change)."""
        if self.pushed is not None:
            self.pushed.synchronize()
            self.pushed = None

    def overlay(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` (the trainable's state dict) with the masters in place of the tensors of
        the same names: a checkpoint holds the masters, not a lower-precision copy."""
        masters = dict(self.named_masters)
        return {k: masters[k].detach() if k in masters else v for k, v in state.items()}

    @torch.no_grad()
    def load(self, state: dict[str, torch.Tensor]) -> None:
        """The masters from a checkpoint's state (the names it holds; the rest from the
        parameters), then the parameters from the masters."""
        self._settle()
        for name, p, m in zip(self.names, self.params, self.masters):
            m.copy_(state[name] if name in state else p.detach())
        self.push()

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Copy the masters back to the device after each of ``optimizer``'s steps."""
        optimizer.register_step_pre_hook(lambda *_: self._settle())
        optimizer.register_step_post_hook(lambda *_: self.push())

    def step(self, optimizer: torch.optim.Optimizer, after: Callable[[], None] | None = None) -> None:
        """One update: ``optimizer``'s step over the masters (the device's tensors follow
        through ``attach``'s hook), then ``after`` (the EMA's update), then the masters'
        gradients dropped."""
        optimizer.step()
        if after is not None:
            after()
        optimizer.zero_grad(set_to_none=True)

    def wait(self) -> None:
        """The update done (``OverlappedUpdate`` runs it beside the next forward; here it
        is done when ``step`` returns)."""

    def host_bytes(self) -> int:
        """Masters, their gradients and the landing buffers (the last in the gradients'
        dtype: counted as the parameters')."""
        return sum(m.numel() * (2 * m.element_size() + p.element_size())
                   for m, p in zip(self.masters, self.params))


def _landing_hook(update: weakref.ref, i: int):
    def hook(p: torch.Tensor) -> None:
        if (live := update()) is not None:
            live.land(i, p)
    return hook
