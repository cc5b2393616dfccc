"""Data-parallel training over the plan's ranks (``docs/parallel.md``).

The plan already holds ``world_size x grad_accum`` micro-batches per step; global batch
``g`` is rank ``g % world_size``'s. A process of ``Dist(rank, world)`` takes the batches
``g = index * world + rank``: with ``world == parallel.world_size`` one rank each (what
torchrun starts), with one process all of them (the single-device reference the tests
compare against). Sigmas, noise and adapter dropout are keyed by the global batch and the
plan's rank, so every sample gets the draws a single device would give it.

- ``init_distributed(params)``: the process group from torchrun's environment (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, its rendezvous), checked against ``parallel.world_size``.
- ``GradientReducer(tensors, dist, overlap)``: the sum of the trained tensors' gradients
  over the ranks, in fixed flat buckets (``plan_buckets``), once a step, so accumulation
  never communicates; with ``overlap`` each bucket's all-reduce starts in the step's last
  backward as soon as its gradients have landed (DDP's overlap), the rest at the step's
  end, the sums the same bit for bit. ``reduce_gradients`` is it without overlap. With the
  host update the gradients are the masters' fp32 ones on the host (under NCCL each bucket
  goes through the device). The adapters live outside the model's modules and its
  forward, so torch's DDP module wrapper (whose reducer hooks on its own forward) does not
  fit them: this is its arithmetic and its overlap, on the tensors themselves.
- ``launch_command(...)``: the ``torch.distributed.run`` command ``kmoss train`` re-runs itself
  under when ``parallel.world_size > 1`` and no process group is set up yet.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist_

from kohakumoss.config import parallel_mode  # noqa: F401  (how the ranks share the work)
from kohakumoss.configlib import ConfigError

BUCKET_BYTES = 64 * 2**20  # gradients all-reduced together, at most this many bytes at a time


@dataclasses.dataclass(frozen=True)
class Dist:
    """This process's place among the training processes."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes checkpoints, metrics and previews."""
        return self.rank == 0

    @property
    def group(self) -> bool:
        """Whether a process group connects this process to others."""
        return self.world > 1


def under_launcher() -> bool:
    """Whether torchrun (or another launcher setting its variables) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(params, device_type: str) -> Dist:
    """The process group of a torchrun-started run (nothing without one), checked against
    ``parallel.world_size``; sets the CUDA device to the local rank's."""
    if not under_launcher():
        return Dist()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if world != params.parallel.world_size:
        raise ConfigError(f"{params.path}: parallel.world_size = {params.parallel.world_size} but "
                          f"{world} processes were started; the plan holds "
                          f"{params.parallel.world_size} ranks' batches: start as many (kmoss train "
                          f"launches them itself), or set parallel.world_size and re-plan")
    backend = params.parallel.backend
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(local)
    if not dist_.is_initialized():
        dist_.init_process_group(backend, rank=rank, world_size=world,
                                 timeout=datetime.timedelta(seconds=params.parallel.timeout_s))
    return Dist(rank, world, local)


def plan_buckets(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The trained tensors in order, cut into buckets of one dtype and device of at most
    ``BUCKET_BYTES`` (a larger tensor alone): fixed for the run, so every rank makes the same
    all-reduces in the same order whichever gradients it has."""
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for t in tensors:
        last, nbytes = buckets[-1], t.numel() * t.element_size()
        if last and (t.dtype != last[0].dtype or t.device != last[0].device
                     or size + nbytes > BUCKET_BYTES):
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    return [b for b in buckets if b]


class GradientReducer:
    """The ranks' gradients summed in place, bucket by bucket (``plan_buckets``; a tensor with
    no gradient adds zeros there and keeps none). With ``overlap`` (DDP's way), once armed for
    the step's last backward (``arm``), each bucket's all-reduce starts as soon as every one
    of its gradients has landed (``Tensor.register_post_accumulate_grad_hook``), in the one
    order every rank follows (the buckets last to first, as backward makes them; a bucket
    ready early waits for those before it), while backward goes on; ``finish`` starts the
    rest, waits for all and writes the sums back. The sums are those of ``finish`` alone (the
    same buffers, the same order), bit for bit."""

    def __init__(self, tensors: Sequence[torch.Tensor], d: Dist, overlap: bool = False):
        self.d, self.buckets = d, plan_buckets(list(tensors))
        self.order = list(range(len(self.buckets)))[::-1]  # backward makes the last first
        self.armed, self.works = False, {}
        self.launched_in_backward = 0  # buckets started before ``finish`` in the last step
        self._left: list[int] = []
        self._next = 0
        self._hooks = []
        if overlap and d.group:
            where = {id(t): i for i, b in enumerate(self.buckets) for t in b}
            for t in tensors:
                if t.is_leaf and t.requires_grad:
                    self._hooks.append(t.register_post_accumulate_grad_hook(
                        lambda t, i=where[id(t)]: self._landed(i)))

    def arm(self) -> None:
        """Before the step's last backward: its gradients are final as they land."""
        if self.d.group and self._hooks:
            self.armed, self.works, self._next = True, {}, 0
            self._left = [len(b) for b in self.buckets]
            self.launched_in_backward = 0

    def _landed(self, i: int) -> None:
        if not self.armed:
            return
        self._left[i] -= 1
        while self._next < len(self.order) and self._left[self.order[self._next]] == 0:
            self._launch(self.order[self._next])
            self.launched_in_backward += 1
            self._next += 1

    def _launch(self, i: int) -> None:
        bucket = self.buckets[i]
        flat = torch.cat([(t.grad if t.grad is not None else torch.zeros_like(t)).reshape(-1)
                          for t in bucket])
        # NCCL reduces device memory only: host gradients (the host update's masters) go
        # through the device one bucket at a time
        staged = flat.device.type == "cpu" and dist_.get_backend() == "nccl"
        if staged:
            flat = flat.to(torch.device("cuda", torch.cuda.current_device()))
        self.works[i] = (dist_.all_reduce(flat, op=dist_.ReduceOp.SUM, async_op=True), flat, staged)

    def finish(self) -> None:
        """Start what backward did not, wait for every bucket, write the sums back."""
        if not self.d.group:
            return
        self.armed = False
        for i in self.order:
            if i not in self.works:
                self._launch(i)
        for i in self.order:
            work, flat, staged = self.works.pop(i)
            work.wait()
            flat = flat.cpu() if staged else flat
            for t, part in zip(self.buckets[i], flat.split([t.numel() for t in self.buckets[i]])):
                if t.grad is not None:
                    t.grad.copy_(part.view_as(t.grad))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def reduce_gradients(tensors: Sequence[torch.Tensor], d: Dist) -> None:
    """Sum every tensor's gradient over the processes (in place, bucketed: ``GradientReducer``
    without overlap)."""
    GradientReducer(tensors, d).finish()


def reduce_sum(values: Sequence[float], d: Dist) -> list[float]:
    """``values`` summed over the processes (float64 on the host)."""
    if not d.group:
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64)
    if dist_.get_backend() == "nccl":
        t = t.cuda()
    dist_.all_reduce(t, op=dist_.ReduceOp.SUM)
    return t.cpu().tolist()


def barrier(d: Dist) -> None:
    if d.group:
        dist_.barrier()


def shutdown(d: Dist) -> None:
    if d.group and dist_.is_initialized():
        dist_.destroy_process_group()


def device_problem(params, device_type: str, count: int | None = None) -> str | None:
    """Why this machine cannot host its share of the ranks (``count`` CUDA devices, default
    the ones it has), or None: on CUDA each rank of a node takes one device."""
    par = params.parallel
    if count is None:
        count = torch.cuda.device_count() if device_type == "cuda" else 0
    per_node = max(1, par.world_size // par.nodes)
    if device_type != "cuda" or par.world_size == 1 or per_node <= count:
        return None
    return (f"parallel.world_size = {par.world_size} on {par.nodes} node(s) puts {per_node} ranks "
            f"on this machine, which has {count} CUDA device(s): set parallel.world_size to at "
            f"most {count * par.nodes}, or train.device: cpu")


def launch_command(params, train_args: Sequence[str], device_type: str = "cpu") -> list[str]:
    """``python -m torch.distributed.run ... -m stages.cli train ARGS`` for the params'
    ranks: one node standalone, several through the c10d rendezvous at
    ``parallel.rdzv_endpoint`` (each node runs the same command). Refused when this machine
    has fewer devices than its ranks (``device_problem``)."""
    par = params.parallel
    if problem := device_problem(params, device_type):
        raise ConfigError(f"{params.path}: {problem}")
    if par.world_size % par.nodes:
        raise ConfigError(f"{params.path}: parallel.world_size = {par.world_size} is not a multiple of "
                          f"parallel.nodes = {par.nodes} (each node starts world_size / nodes ranks)")
    per_node = par.world_size // par.nodes
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={per_node}",
           f"--nnodes={par.nodes}"]
    if par.nodes == 1:
        cmd.append("--standalone")
    else:
        if not par.rdzv_endpoint:
            raise ConfigError(f"{params.path}: parallel.nodes = {par.nodes} needs parallel.rdzv_endpoint "
                              f"(host:port of one node, the same on every node)")
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={par.rdzv_endpoint}",
                f"--rdzv-id={params.run.name}"]
    return cmd + ["-m", "stages.cli", "train", *train_args]
