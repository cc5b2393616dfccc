"""Where weight streaming keeps its host copies (``streaming.WeightRing``): the process's own
page-locked buffers (``OwnCopies``), or one copy per node that the node's ranks share
(``NodeCopies``, ``docs/parallel.md#the-memory-profiles-over-several-ranks``).

A data-parallel run starts one process per GPU. Each streams the same frozen base, so with
its own copies a node of 8 ranks would hold 8 copies of the base in host memory (80 GiB for
MOSS-Image's bf16 blocks). ``NodeCopies`` gives the node one:

1. the node's first rank (``leader``) makes a file in ``/dev/shm`` of the copies' size and
   maps it shared; the others map the same file once it exists (a barrier between). Where
   there is no ``/dev/shm`` (Windows, macOS: ``portable.shm_root``) the copies are a named
   ``multiprocessing.shared_memory`` block instead, made and attached the same way;
2. the leader writes the weights into it; the others write nothing;
3. after a second barrier the leader unlinks the file (the mappings stay until the processes
   end, so nothing is left behind), and on CUDA each process registers the mapping as
   page-locked memory (``cudaHostRegister``), so the device copies from it asynchronously.

The copies are read-only after that: they hold a frozen base (a full finetune's streamed
blocks are written by its host update, and such a run does not shard over ranks).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Sequence

import torch

import kohakumoss.portable as portable

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
                 root: str | None = None):
        root = root if root is not None else portable.shm_root()
        self.name = f"kmoss-{name}.weights"
        self.path = os.path.join(root, self.name) if root is not None else None
        self.leader, self.barrier, self.pin = leader, barrier, pin
        self.buffer: torch.Tensor | None = None
        self.shared = None  # the shared-memory block where there is no tmpfs

    def make(self, numels: Sequence[int], dtype: torch.dtype) -> tuple[list[torch.Tensor], bool]:
        size = torch.empty((), dtype=dtype).element_size()
        offsets, total = [], 0
        for n in numels:
            offsets.append(total)
            total += -(-n * size // ALIGN) * ALIGN
        if self.path is None:
            self._shared_memory(total)
        else:
            self._file(total)
        flats = [self.buffer[at:at + n * size].view(dtype) for at, n in zip(offsets, numels)]
        return flats, self.leader

    def _file(self, total: int) -> None:
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

    def _shared_memory(self, total: int) -> None:
        from multiprocessing import resource_tracker, shared_memory

        if self.leader:
            with contextlib.suppress(FileNotFoundError):  # a crashed run's leftover
                old = shared_memory.SharedMemory(self.name)
                old.close()
                old.unlink()
            self.shared = shared_memory.SharedMemory(self.name, create=True, size=max(1, total))
        self.barrier()  # the block exists, at its size
        if not self.leader:
            try:
                self.shared = shared_memory.SharedMemory(self.name)
            except FileNotFoundError:
                raise RuntimeError(f"shared memory {self.name}: the node's shared weight copies "
                                   f"are missing: every rank of a node must stream the same "
                                   f"base") from None
            with contextlib.suppress(Exception):  # the leader owns it, not this rank's tracker
                resource_tracker.unregister(self.shared._name, "shared_memory")
            if self.shared.size < total:
                raise RuntimeError(f"shared memory {self.name} holds {self.shared.size} bytes, "
                                   f"this rank's model {total}: every rank of a node must "
                                   f"stream the same base")
        self.buffer = torch.frombuffer(self.shared.buf, dtype=torch.uint8, count=total) \
            if total else torch.empty(0, dtype=torch.uint8)

    def done(self) -> None:
        self.barrier()  # the leader has written every copy; every rank has mapped the file
        if self.leader and self.path is not None and os.path.exists(self.path):
            os.unlink(self.path)
        if self.leader and self.shared is not None and sys.platform != "win32":
            self.shared.unlink()  # the mappings stay until the processes end
        if self.pin and self.buffer is not None and self.buffer.numel():
            err = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.buffer.numel(), 0)
            if int(err) != 0:
                raise RuntimeError(f"{self.path or self.name}: registering the node's shared weight copies "
                                   f"({self.buffer.numel()} bytes) as page-locked memory failed "
                                   f"with CUDA error {int(err)}; CUDA registers a mapping of "
                                   f"tmpfs (/dev/shm), not of a file on disk")

    def host_bytes(self) -> int:
        """The node's copies (counted once per node)."""
        return 0 if self.buffer is None else self.buffer.numel()
