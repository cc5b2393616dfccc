"""The next micro-batch made while the device runs the current one (``training.ahead``):
each made once, in order, with its step; an error raised where the micro-batch is taken."""

from __future__ import annotations

import pytest

from kohakumoss.training.ahead import Ahead


def test_micro_batches_are_made_once_in_order_with_their_step():
    made = []

    def make(batch, step):
        made.append((batch, step))
        return batch * 10

    ahead = Ahead(iter(range(6)), make, first_step=1, per_step=3)  # a resumed run: step 1 on
    assert ahead.take() == 0 and made == [(0, 1)]
    ahead.prepare()  # the next one, before it is taken
    assert made[-1] == (1, 1)
    assert [ahead.take() for _ in range(5)] == [10, 20, 30, 40, 50]
    assert made == [(0, 1), (1, 1), (2, 1), (3, 2), (4, 2), (5, 2)]
    ahead.prepare()  # past the end: nothing
    with pytest.raises(RuntimeError, match="no more micro-batches"):
        ahead.take()


def test_an_error_making_a_micro_batch_is_raised_when_it_is_taken():
    def make(batch, step):
        if batch == 1:
            raise OSError("cache shard unreadable")
        return batch

    ahead = Ahead(iter(range(3)), make, first_step=0, per_step=1)
    assert ahead.take() == 0
    ahead.prepare()  # made early: the error waits for its turn
    with pytest.raises(OSError, match="unreadable"):
        ahead.take()
    assert ahead.take() == 2
