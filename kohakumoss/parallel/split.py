"""The joint blocks split over several devices of one process (``parallel.mode: threaded``,
``docs/parallel.md#threaded``).

A model that no one card holds (the 10 GiB bf16 base and a step on a 12 GB and an 11 GB card)
runs with its 42 joint blocks in contiguous stages, one a device. The first device holds
everything else too (the embedders, the text refiner, the conditioning, the head and the
step's own tensors) and the batch; the joint stream crosses to the next device at the first
block of each stage and comes back to the first device after the last block, where the
head and the loss run. Backward crosses the same way (the copies are differentiable) and
PyTorch's autograd engine runs each device's part of it on that device's own thread.

How many blocks each device takes follows the memory estimate (``plan_split``): the step's
predicted peak per device is its blocks' share (each block's weights, trained tensors,
gradients, optimizer states and kept activations: the estimate's difference between the
model and the model one block shorter) plus, on the first device, what is not a joint
block, and on every other device the backward's working set. The split is the one that
leaves the most room on the fullest device, relative to each device's free memory.

A device split is an engine of the model's registry (``Handle`` "device split"): it owns the
blocks at the stages' edges (they run whole, their inputs moved in) and undoes itself by
moving every block back to the first device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from kohakumoss.device import indexed, resolve_device
from kohakumoss.model.engines import Handle

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class StageCosts:
    """Predicted bytes of one step, by where they live (``training.autoprofile.stage_costs``)."""

    per_block: tuple[int, ...]  # each joint block: weights, trained tensors, gradients,
    # optimizer states, kept activations (partial checkpointing: its first blocks keep less)
    first: int  # the rest, on the first device: other modules, step tensors, working set
    other: int  # on every other device: the backward's working set

    @property
    def depth(self) -> int:
        return len(self.per_block)


@dataclasses.dataclass(frozen=True)
class Split:
    devices: tuple[torch.device, ...]
    stages: tuple[range, ...]  # the joint blocks each device holds, in order
    peaks: tuple[int, ...]  # each device's predicted peak
    free: tuple[int, ...]  # each device's free memory when planned

    @property
    def fits(self) -> bool:
        return all(p <= f for p, f in zip(self.peaks, self.free))

    def describe(self) -> str:
        parts = []
        for i, (dev, stage, peak, free) in enumerate(zip(self.devices, self.stages, self.peaks, self.free)):
            blocks = f"blocks {stage.start}-{stage.stop - 1}" if len(stage) else "no blocks"
            extra = " + embedders, text refiner, head, loss" if i == 0 else ""
            parts.append(f"{dev}: {blocks}{extra} ({_size(peak)} predicted of {_size(free)})")
        return "; ".join(parts)


def plan_split(costs: StageCosts, devices: Sequence[torch.device], free: Sequence[int]) -> Split:
    """The contiguous split of the blocks over ``devices`` (each with ``free`` bytes) that
    keeps the fullest device's predicted peak, relative to its free memory, lowest; every
    device takes at least one block where there are enough of them."""
    n, depth, per = len(devices), costs.depth, costs.per_block
    base = [costs.first] + [costs.other] * (n - 1)
    least = 1 if depth >= n else 0

    def counts(ratio: float) -> list[int] | None:  # blocks each device holds at this fill
        out, at = [], 0
        for i in range(n):
            room, take = ratio * free[i] - base[i], 0
            most = depth - at - least * (n - 1 - i)
            while i == n - 1 and at + take < depth or take < most and (
                    take < least or sum(per[at:at + take + 1]) <= room):
                take += 1
            if base[i] + sum(per[at:at + take]) > ratio * free[i] + 1:
                return None
            out.append(take)
            at += take
        return out if at == depth else None

    lo, hi = 0.0, 1.0
    while counts(hi) is None and hi < 2**20:  # the fill at which a split exists (above 1: no fit)
        hi *= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if counts(mid) is not None else (mid, hi)
    taken = counts(hi) or [depth] + [0] * (n - 1)
    stages, start = [], 0
    for k in taken:
        stages.append(range(start, start + k))
        start += k
    peaks = tuple(base[i] + sum(per[s.start:s.stop]) for i, s in enumerate(stages))
    return Split(tuple(devices), tuple(stages), peaks, tuple(int(f) for f in free))


def _size(b: float) -> str:
    return f"{b / GiB:.1f} GiB" if b >= GiB else f"{b / 2**20:.1f} MiB"


def split_devices(names: Sequence[str], run_device: torch.device) -> tuple[torch.device, ...]:
    """The devices of ``parallel.devices`` (``names``), the first the run's own
    (``train.device``); none named: every visible CUDA card, or two stages on the CPU."""
    run_device = indexed(run_device)
    if not names:
        if run_device.type == "cuda":
            n = torch.cuda.device_count()
            if n < 2:
                raise ValueError("parallel.mode: threaded splits the model over several devices "
                                 "and one CUDA device is visible: list them in parallel.devices, "
                                 "or use parallel.mode: auto")
            return tuple(torch.device("cuda", (run_device.index + i) % n) for i in range(n))
        return (run_device, run_device)
    devices = tuple(indexed(resolve_device(n)) for n in names)
    if devices[0] != run_device:
        raise ValueError(f"parallel.devices[0] = {names[0]!r} is not train.device ({run_device}): "
                         f"the first device holds the batch, the head and the loss; list "
                         f"{run_device} first or set train.device: {names[0]}")
    return devices


def _moved(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (tuple, list)):
        return type(value)(_moved(v, device) for v in value)
    return value


def apply_device_split(model: nn.Module, split: Split) -> Handle:
    """Place ``model``'s joint blocks as ``split`` says and everything else on its first
    device; the first block of each later stage takes its inputs to its device and the last
    block hands the stream back to the first device."""
    layers = model.layers
    first = split.devices[0]
    if sum(len(s) for s in split.stages) != len(layers):
        raise ValueError(f"the split places {sum(len(s) for s in split.stages)} joint blocks; "
                         f"the model has {len(layers)}")
    for name, child in model.named_children():
        if name != "layers":
            child.to(first)
    edges: list[tuple[nn.Module, torch.device]] = []
    for device, stage in zip(split.devices, split.stages):
        for i in stage:
            layers[i].to(device)
        if len(stage) and stage.start > 0:  # (on one device the move is no move)
            edges.append((layers[stage.start], device))
    last = layers[len(layers) - 1]
    back = bool(edges)

    def undo() -> None:
        layers.to(first)

    owned = tuple(dict.fromkeys([b for b, _ in edges] + ([last] if back else [])))
    handle = model.engines.register(Handle("device split", state=split, blocks=owned, undo=undo))
    for block, device in edges:
        model.engines.wrap_part(handle, block, "forward", lambda run, d=device: (
            lambda x, *rest: run(_moved(x, d), *_moved(rest, d))))
    if back:
        model.engines.wrap_part(handle, last, "forward", lambda run: (
            lambda *args: run(*args).to(first, non_blocking=True)))
    return handle
