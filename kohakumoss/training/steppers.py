"""Steppers: how one optimiser step's gradients become the update (``memory.optimizer`` and
``parallel``; ``docs/engines.md, "Adding a stepper"``).

A ``Stepper`` owns everything between the loss and the next step: the backward of each
micro-batch, the gradients' reduction over the data-parallel ranks, clipping and the
finite check, the optimizer's step, the EMA after it, and the trained state a checkpoint
holds. ``Trainer`` calls the same methods whatever runs underneath:

- ``Stepper``: the optimizer steps on the device (``memory.optimizer: device``);
- ``StreamedStepper``: its states live on the host and come in per group (``streamed``);
- ``FusedStepper``: each tensor is stepped inside the last backward (``fused``);
- ``HostStepper``: host masters take the gradients and step there, beside the next forward
  when overlapped (``host``);
- ``ShardedStepper``: a full finetune over ranks (FSDP2), each rank stepping its shard;
- ``AveragedStepper``: an optimizer that trains one sequence of weights and evaluates
  another (schedule-free AdamW): previews, validation and checkpoints see the averaged one.

Loss scaling (fp16) wraps any of them: the loss is scaled before backward, the gradients
unscaled before the norm, an overflow skips the step (``NoScaling`` where there is none).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kohakumoss.errors import KohakuError
from kohakumoss.memory.host_update import HostUpdate
from kohakumoss.memory.stepping import FusedStep, StreamedStates
from kohakumoss.parallel import Dist, GradientReducer
from kohakumoss.precision.scaler import LossScaler
from kohakumoss.training.ema import EMA
from kohakumoss.training.optim import clip_and_check


class NoScaling:
    """The loss scaler of a run without one: every call leaves things as they are."""

    scale = None

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale(self, tensors) -> None:
        pass

    def update(self, finite: bool) -> None:
        pass

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state) -> None:
        pass


class Stepper:
    """The optimizer's step on the device, after the ranks' gradients are summed (their
    all-reduces overlapping the step's last backward: ``parallel.GradientReducer``)."""

    kind = "device"
    collective = False  # every rank takes part in previews and checkpoints (a sharded model)
    overlaps_reduce = True  # the gradients are the tensors' own, on the device, as they land

    def __init__(self, optimizer: torch.optim.Optimizer, named: list[tuple[str, torch.Tensor]],
                 trainable, grad_clip: float, ema: EMA | None = None,
                 scaler: LossScaler | None = None, dist: Dist = Dist()):
        self.optimizer, self.trainable, self.grad_clip = optimizer, trainable, grad_clip
        self.tensors = [t for _, t in named]  # what is clipped and stepped (together)
        self.ema, self.dist = ema, dist
        self.scaler = scaler if scaler is not None else NoScaling()
        self.reducer = GradientReducer(self.tensors, dist, overlap=self.overlaps_reduce)

    # -- each micro-batch ------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """The micro-batch's backward (``last``: the step's last micro-batch, whose gradients
        start their all-reduces as they land)."""
        if last:
            self.reducer.arm()
        self.scaler.scaled(loss).backward()

    def after_backward(self) -> None:
        """Once the next micro-batch is on its way (the loader's work beside this backward)."""

    # -- the step's end --------------------------------------------------------------------
    def reduce(self) -> None:
        """The ranks' gradients summed (the losses are normalised by the whole step's tokens)."""
        self.reducer.finish()

    def update(self, step: int) -> tuple[float, bool]:
        """Clip, check, step and average; returns the gradient norm and whether it was
        finite (a non-finite step is skipped, and the scale halves under fp16)."""
        self.scaler.unscale(self.tensors)  # the gradients at their true size before the norm
        grad_norm, finite = clip_and_check(self.tensors, self.grad_clip)
        self.scaler.update(finite)
        if finite:
            self.apply()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, finite

    def apply(self) -> None:
        self.optimizer.step()
        self._averaged()

    def _averaged(self) -> None:
        if self.ema is not None:
            self.ema.update()

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Around a preview or a validation pass: the weights the run evaluates in place."""
        yield

    # -- checkpoints -----------------------------------------------------------------------
    def wait(self) -> None:
        """Before the state is read: nothing of an update still at work."""

    @property
    def writes(self) -> bool:
        """Whether this process writes the checkpoint (every rank of a sharded run gathers)."""
        return True

    def trained_state(self) -> tuple[dict, dict[str, torch.Tensor], torch.Tensor | Any]:
        """(the optimizer's state, the trained tensors, the EMA's averages) as saved."""
        shadow = self.ema.shadow if self.ema is not None else None
        return self.optimizer.state_dict(), self.trainable.state_dict(), shadow

    def load_trained(self, trained: dict[str, torch.Tensor], optimizer: dict) -> None:
        self.trainable.load_state_dict(trained)
        self.optimizer.load_state_dict(optimizer)


class StreamedStepper(Stepper):
    """The optimizer's states on the host, brought in per group for its step."""

    kind = "streamed"

    def __init__(self, streamed: StreamedStates, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.streamed = streamed

    def apply(self) -> None:
        self.streamed.step()
        self._averaged()


class FusedStepper(Stepper):
    """Each tensor stepped as its gradient lands in the step's last backward (no clipping:
    refused with it); a non-finite norm found after cannot be undone and stops the run."""

    kind = "fused"
    overlaps_reduce = False  # its update runs inside backward as each gradient lands

    def __init__(self, fused: FusedStep, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fused = fused

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        if last:
            self.fused.arm()  # the step's last backward updates each tensor as it lands
        super().backward(loss, last)

    def update(self, step: int) -> tuple[float, bool]:
        grad_norm, finite = self.fused.finish()
        if not finite:
            raise KohakuError(
                f"step {step + 1}: non-finite gradient norm ({grad_norm}) under "
                f"memory.optimizer: fused, whose update ran inside backward and cannot be "
                f"skipped; the run stops here. Resume from the last checkpoint with "
                f"memory.optimizer: device (which skips such a step) or a lower optim.lr")
        self.scaler.update(finite)
        self._averaged()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, finite


class HostStepper(Stepper):
    """Host masters (``HostUpdate``; overlapped with the next forward for an adapter) take
    the gradients as they land and step there; the device keeps no optimizer state."""

    kind = "host"
    overlaps_reduce = False  # the gradients go to the host masters as they land

    def __init__(self, host: HostUpdate, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.host = host

    def after_backward(self) -> None:
        self.host.finish_backward()

    def update(self, step: int) -> tuple[float, bool]:
        self.scaler.unscale(self.tensors)
        grad_norm, finite = clip_and_check(self.tensors, self.grad_clip)
        self.scaler.update(finite)
        if finite:  # steps, then the EMA, then drops the gradients (overlapped: beside the
            self.host.step(self.optimizer, self.ema.update if self.ema is not None else None)
        else:  # next forward)
            self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, finite

    def wait(self) -> None:
        self.host.wait()

    def trained_state(self):
        optimizer, state, shadow = super().trained_state()
        return optimizer, self.host.overlay(state), shadow  # the masters, not a compute-dtype copy

    def load_trained(self, trained, optimizer) -> None:
        super().load_trained(trained, optimizer)
        self.host.load(trained)


class ShardedStepper(Stepper):
    """A full finetune over ranks (FSDP2): each rank steps its shard; FSDP2 reduce-scatters
    the gradients itself (as averages: the loss is made the sum first), and every rank
    gathers the state a checkpoint holds, rank 0 writing it."""

    kind = "sharded"
    overlaps_reduce = False  # FSDP2 reduce-scatters the gradients itself
    collective = True

    def __init__(self, model: torch.nn.Module, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model = model

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        super().backward(loss * self.dist.world, last)

    def reduce(self) -> None:
        pass

    @property
    def writes(self) -> bool:
        return self.dist.main

    def trained_state(self):
        from kohakumoss.parallel import fsdp

        shadow = fsdp.gathered(self.ema.shadow) if self.ema is not None else None
        return fsdp.optimizer_state(self.model, self.optimizer), fsdp.model_state(self.model), shadow

    def load_trained(self, trained, optimizer) -> None:
        from kohakumoss.parallel import fsdp

        fsdp.load_model_state(self.model, trained)
        fsdp.load_optimizer_state(self.model, self.optimizer, optimizer)


class AveragedStepper(Stepper):
    """Schedule-free AdamW (``schedulefree.AdamWScheduleFree``): the parameters hold the
    trained sequence ``y``; the weights to evaluate are ``x = y + (1 - 1/beta1) (z - y)``
    (the library's ``eval()``, computed by the same ``lerp``). Previews and validation run
    with ``x`` in place and ``y`` restored bit for bit after; a checkpoint's trained tensors
    are ``x`` (what export and sampling read) and its optimizer state carries ``y``
    (``train_weights``, in parameter order) for the resume."""

    kind = "averaged"

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        with torch.no_grad():
            trained = [t.detach().clone() for t in self.tensors]
            for group in self.optimizer.param_groups:
                beta1 = group["betas"][0]
                for t in group["params"]:
                    z = self.optimizer.state.get(t, {}).get("z")
                    if z is not None:
                        t.copy_(torch.lerp(t, z.to(t.device), 1 - 1 / beta1))
        try:
            yield
        finally:
            with torch.no_grad():
                for t, y in zip(self.tensors, trained):
                    t.copy_(y)

    def trained_state(self):
        optimizer = self.optimizer.state_dict()
        optimizer["train_weights"] = [t.detach().clone() for t in self.tensors]
        with self.evaluating():
            state = {k: v.detach().clone() for k, v in self.trainable.state_dict().items()}
        return optimizer, state, None

    def load_trained(self, trained, optimizer) -> None:
        optimizer = dict(optimizer)
        weights = optimizer.pop("train_weights", None)
        if weights is None or len(weights) != len(self.tensors):
            raise KohakuError("the checkpoint's optimizer state holds no schedule-free "
                              "train_weights for these trained tensors: resume it with the "
                              "optim.name it was trained with")
        super().load_trained(trained, optimizer)
        with torch.no_grad():
            for t, y in zip(self.tensors, weights):
                t.copy_(y)


def make_stepper(optimizer: torch.optim.Optimizer, named: list[tuple[str, torch.Tensor]], trainable,
                 grad_clip: float, *, model: torch.nn.Module, ema: EMA | None,
                 scaler: LossScaler | None, dist: Dist, host: HostUpdate | None = None,
                 fused: FusedStep | None = None, streamed: StreamedStates | None = None,
                 sharded: bool = False, averaged: bool = False) -> Stepper:
    """The one stepper of a run's ``memory.optimizer``, parallel mode and optimizer
    (``averaged``: one that evaluates averaged weights; refused with the others)."""
    common: tuple[Any, ...] = (optimizer, named, trainable, grad_clip)
    kw: dict[str, Any] = dict(ema=ema, scaler=scaler, dist=dist)
    build: Callable[[], Stepper] = (
        (lambda: ShardedStepper(model, *common, **kw)) if sharded else
        (lambda: HostStepper(host, *common, **kw)) if host is not None else
        (lambda: FusedStepper(fused, *common, **kw)) if fused is not None else
        (lambda: StreamedStepper(streamed, *common, **kw)) if streamed is not None else
        (lambda: AveragedStepper(*common, **kw)) if averaged else
        (lambda: Stepper(*common, **kw)))
    return build()
