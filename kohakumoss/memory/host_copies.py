"""Where weight streaming keeps its host copies (``streaming.WeightRing``): the process's own
page-locked buffers (``OwnCopies``), or one copy per node that the node's ranks share
(``NodeCopies``, ``docs/parallel.md#the-memory-profiles-over-several-ranks``).

A data-parallel run starts one process per GPU. Each streams the same frozen base, so with
its own copies a node of 8 ranks would hold 8 copies of the base in host memory (80 GiB for
MOSS-Image's bf16 blocks). ``NodeCopies`` gives the node one:

1. the node's first rank (``leader``) makes a file in ``/dev/shm`` of the copies' size and
   maps it shared; the others map the same file once it exists (a barrier between);
2. the leader writes the weights into it; the others write nothing;
3. after a second barrier the leader unlinks the file (the mappings stay until the processes
   end, so nothing is left behind), and on CUDA each process registers the mapping as
   page-locked memory (``cudaHostRegister``), so the device copies from it asynchronously.

The copies are read-only after that: they hold a frozen base (a full finetune's streamed
blocks are written by its host update, and such a run does not shard over ranks).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

ALIGN = 256  # bytes: every copy starts on a boundary a device copy is fast from


class OwnCopies:
    """Page-locked (on CUDA) buffers of this process's own."""

    def __init__(self, pin: bool):
        self.pin = pin

    def make(self, numels: Sequence[int], dtype: torch.dtype) -> tuple[list[torch.Tensor], bool]:
        """One flat buffer per unit; whether this process writes them (always)."""
        return [torch.empty(n, dtype=dtype, pin_memory=self.pin) for n in numels], True

    def done(self) -> None:
        """The buffers are written."""


class NodeCopies:
    """One copy per node, in a file of ``/dev/shm`` the node's ranks map (see the module).
    ``name``: the same on every rank of the run and unique to it; ``barrier``: waits for
    every rank of the run."""

    def __init__(self, name: str, leader: bool, barrier: Callable[[], None], pin: bool,
                 root: str = "/dev/shm"):
        self.path = os.path.join(root, f"kmoss-{name}.weights")
        self.leader, self.barrier, self.pin = leader, barrier, pin
        self.buffer: torch.Tensor | None = None

    def make(self, numels: Sequence[int], dtype: torch.dtype) -> tuple[list[torch.Tensor], bool]:
        size = torch.empty((), dtype=dtype).element_size()
        offsets, total = [], 0
        for n in numels:
            offsets.append(total)
            total += -(-n * size // ALIGN) * ALIGN
        if self.leader:
            if os.path.exists(self.path):
                os.unlink(self.path)  # a crashed run's leftover of the same name
            self.buffer = torch.from_file(self.path, shared=True, size=total, dtype=torch.uint8)
        self.barrier()  # the file exists, at its size
        if not self.leader:
            if not os.path.exists(self.path) or os.path.getsize(self.path) != total:
                raise RuntimeError(f"{self.path}: the node's shared weight copies are missing or "
                                   f"of another size than this rank's model ({total} bytes): every "
                                   f"rank of a node must stream the same base")
            self.buffer = torch.from_file(self.path, shared=True, size=total, dtype=torch.uint8)
        flats = [self.buffer[at:at + n * size].view(dtype) for at, n in zip(offsets, numels)]
        return flats, self.leader

    def done(self) -> None:
        self.barrier()  # the leader has written every copy; every rank has mapped the file
        if self.leader and os.path.exists(self.path):
            os.unlink(self.path)
        if self.pin and self.buffer is not None and self.buffer.numel():
            err = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.buffer.numel(), 0)
            if int(err) != 0:
                raise RuntimeError(f"{self.path}: registering the node's shared weight copies "
                                   f"({self.buffer.numel()} bytes) as page-locked memory failed "
                                   f"with CUDA error {int(err)}; CUDA registers a mapping of "
                                   f"tmpfs (/dev/shm), not of a file on disk")

    def host_bytes(self) -> int:
        """The node's copies (counted once per node)."""
        return 0 if self.buffer is None else self.buffer.numel()
