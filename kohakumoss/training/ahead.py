"""The next micro-batch's inputs, made while the device runs the current one.

A step's host work (reading the caches, drawing noise and sigmas, packing, the copies to
the device) would otherwise sit between two steps with the device idle: the trainer syncs
at the end of every backward (the loss, the gradient norm, the host update's gradients). The
trainer asks for the next micro-batch right after enqueueing a backward, before any of
those syncs, so the device is still busy while the host makes it.

What is made does not depend on when: noise and sigmas are keyed by (seed, batch, step),
and dropout is seeded when the micro-batch runs. An error while making one is kept and
raised when that micro-batch is taken, where it would have been raised without the lead.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any


class Ahead:
    """``make(batch, step)`` over ``loader``'s micro-batches, ``per_step`` to a step from
    ``first_step`` on, one micro-batch ahead of ``take``."""

    def __init__(self, loader: Iterator, make: Callable[[Any, int], Any], first_step: int,
                 per_step: int):
        self.loader, self.make, self.per_step = loader, make, per_step
        self.index = first_step * per_step  # the next micro-batch's place in the run
        self.made: collections.deque = collections.deque()  # (value, error)

    def prepare(self) -> None:
        """Make the next micro-batch (nothing past the loader's end)."""
        try:
            batch = next(self.loader)
        except StopIteration:
            return
        step, self.index = self.index // self.per_step, self.index + 1
        try:
            self.made.append((self.make(batch, step), None))
        except Exception as e:  # noqa: BLE001 - raised by take(), in its place
            self.made.append((None, e))

    def take(self) -> Any:
        """The next micro-batch as made (made now if it was not yet)."""
        if not self.made:
            self.prepare()
        if not self.made:
            raise RuntimeError("the plan has no more micro-batches for this run")
        value, error = self.made.popleft()
        if error is not None:
            raise error
        return value
