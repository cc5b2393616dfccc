"""The next micro-batch made while the device runs the current one (``training.ahead``):
each made once, in order, with its step; an error raised where the micro-batch is taken."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

import kohakumoss.setup
from kohakumoss.data.loader import HostBatch
from kohakumoss.params import parse_params
from kohakumoss.training.ahead import Ahead
from kohakumoss.training.inputs import build_inputs, make_timesteps


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


@pytest.mark.gpu
def test_inputs_made_during_a_backward_do_not_wait_for_the_device():
    """``build_inputs`` to CUDA queues its copies behind the device's work: a copy from
    pageable memory would make the host wait for the whole queue, and the device would idle
    while the host then made the rest of the batch."""
    defaults = Path(kohakumoss.setup.__file__).with_name("params.yaml")
    p = parse_params(yaml.safe_load(defaults.read_text()))
    hw = [(4, 6), (5, 5)]
    batch = HostBatch(index=0, rank=0, step=0, micro=0, uids=torch.arange(2), hw=torch.tensor(hw),
                      pixels=[], captions=["a", "b"], text_drop=torch.zeros(2, dtype=torch.bool),
                      loss_weight=torch.ones(2), text_limit=[-1, 2], img_keep=[-1, 11],
                      keep_seed=[0, 3], crops=[], flips=[], skipped=[], global_index=0)
    latents = [torch.randn(h * w, 8) for h, w in hw]
    texts = [torch.randn(3, 16), torch.randn(4, 16)]
    args = (batch, latents, texts, p, make_timesteps(p), 0, 5)
    on_host = build_inputs(*args, "cpu")
    stream = torch.cuda.current_stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of queued device work
    moved = build_inputs(*args, "cuda")
    assert not stream.query(), "building the inputs waited for the device's queued work"
    torch.cuda.synchronize()
    for name in ("z", "target", "text", "sigma", "weight"):
        assert torch.equal(getattr(moved, name).cpu(), getattr(on_host, name)), name
    for name in ("cu_joint", "seg_img", "img_in_joint", "pos_joint", "pos_txt"):
        assert torch.equal(getattr(moved.layout, name).cpu(), getattr(on_host.layout, name)), name
