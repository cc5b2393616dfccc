"""The overlapped host update: the optimizer's step on a worker thread, chunk by chunk in
forward order, beside the next forward. Bit-identical to the plain host update (masters,
device tensors, optimizer state, EMA, losses), even when the worker is slow and the LR
changes under it; a block never reads a tensor before its update has landed."""

from __future__ import annotations

import time

import pytest
import torch

from kohakumoss.adapters.inject import lora_name
from kohakumoss.config import OptimConfig
from kohakumoss.memory import overlap
from kohakumoss.memory.checkpointing import repeated_blocks
from kohakumoss.memory.host_update import HostUpdate
from kohakumoss.memory.overlap import OverlappedUpdate, forward_chunks
from kohakumoss.model import FLAVORS, MOSSImageTransformer, build_layout
from kohakumoss.training.ema import EMA
from kohakumoss.training.optim import build_optimizer, build_scheduler, clip_and_check
from kohakumoss.formats.statefile import flatten_state

from test_streaming import _model

CPU = torch.device("cpu")


def test_chunks_follow_the_forward_and_hold_every_tensor_once():
    model, aset, _ = _model()
    names = [n for n, _ in aset.named_trainable()]
    chunks, gates = forward_chunks(names, model, lora_name)
    assert sorted(i for c in chunks for i in c) == list(range(len(names)))
    blocks = repeated_blocks(model)
    assert gates[0] is model and [g for g in gates[1:]] == [b for _, b in blocks]
    for (path, _), chunk in zip(blocks, chunks[1:]):
        assert chunk and all(names[i].startswith(lora_name(path) + "_") for i in chunk)
    assert chunks[0] and not any(names[i].startswith(lora_name("layers.")[:-1]) for i in chunks[0])
    # a full finetune's names are the model's own paths
    full = [n for n, _ in model.named_parameters()]
    fchunks, _ = forward_chunks(full, model)
    assert all(full[i].startswith("layers.1.") for i in fchunks[len(blocks) - 1])


def _inputs(step, micro, device=CPU):
    g = torch.Generator().manual_seed(100 * step + micro)
    c = FLAVORS["tiny"]
    layout = build_layout([(3, 4), (2, 5)], [4, 6])
    inputs = (torch.randn(layout.n_img, c.latent_channels, generator=g),
              torch.randn(layout.n_txt, c.text_dim, generator=g), torch.rand(2, generator=g), layout)
    return tuple(x.to(device) for x in inputs)


def _trained(full: bool, device=CPU, **engines):
    """The tiny model and what trains: a LoRA's tensors (LyCORIS names), or every weight
    (the model's paths: Muon takes the blocks' matrices). ``engines``: ``_model``'s
    checkpointing, offload and streaming."""
    if not full:
        model, aset, _ = _model(**engines)
        aset.to(device)
        return model.to(device), aset.named_trainable()
    torch.manual_seed(0)
    model = MOSSImageTransformer(FLAVORS["tiny"]).to(device)
    return model, list(model.named_parameters())


def _train(overlapped: bool, name="adamw", steps=4, accum=2, slow=0.0, gated=True, monkeypatch=None,
           full=False, device=CPU, **engines):
    model, named = _trained(full, device, **engines)
    update = OverlappedUpdate(named, device, model, lora_name) if overlapped else HostUpdate(named, device)
    if overlapped and not gated:
        for h in update.gates:
            h.remove()
    cfg = OptimConfig(name=name, lr=5e-2, weight_decay=0.1, warmup_steps=3)
    opt = build_optimizer(update.named_masters, cfg)
    update.attach(opt)
    scheduler = build_scheduler(opt, cfg, steps)
    ema = EMA(update.named_masters, 0.9)
    if slow and monkeypatch is not None:  # each chunk's push late: the forward must wait
        push = OverlappedUpdate._push

        def late(self, k, chunk):
            time.sleep(slow)
            push(self, k, chunk)
        monkeypatch.setattr(OverlappedUpdate, "_push", late)
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(accum):
            loss = model(*_inputs(step, micro, device)).float().square().mean()
            loss.backward()
            update.finish_backward()
            total += loss.item()
        losses.append(total)
        clip_and_check([m for _, m in update.named_masters], 0.5)
        update.step(opt, ema.update)
        scheduler.step()  # at once: the worker's step must keep the LR it started with
    update.wait()
    return losses, named, update, opt, ema


def _same_run(a, b):
    (la, na, ua, oa, ea), (lb, nb, ub, ob, eb) = a, b
    assert la == lb
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(na, nb))
    assert all(torch.equal(x, y) for x, y in zip(ua.masters, ub.masters))
    (ta, sa), (tb, sb) = flatten_state(oa.state_dict()), flatten_state(ob.state_dict())
    assert sa == sb and ta.keys() == tb.keys() and ta
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert all(torch.equal(ea.shadow[k], eb.shadow[k]) for k in ea.shadow)


@pytest.mark.parametrize("name,full", [("adamw", False), ("adamw", True), ("muon", True)])
def test_the_overlapped_update_is_the_host_updates_arithmetic(name, full):
    _same_run(_train(False, name, full=full), _train(True, name, full=full))


@pytest.mark.parametrize("engines", [{}, {"offload": "sub-block", "stream": 2}, {"mode": "block"}],
                         ids=["plain", "minimal", "block"])
def test_a_slow_worker_is_waited_for_block_by_block(monkeypatch, engines):
    """Under checkpointing, offload and streaming too (their recomputation runs the blocks
    again: the gates let it through)."""
    plain = _train(False, **engines)
    _same_run(plain, _train(True, slow=0.02, monkeypatch=monkeypatch, **engines))


def test_without_the_gates_the_forward_reads_stale_tensors(monkeypatch):
    """The control: the same slow worker with the gates taken off. The forward then reads
    tensors the worker has not updated yet, or autograd finds them changed under it."""
    plain = _train(False, steps=3)[0]
    try:
        losses = _train(True, steps=3, slow=0.05, gated=False, monkeypatch=monkeypatch)[0]
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e)
    else:
        assert losses[0] == plain[0] and losses[1:] != plain[1:]


def test_the_optimizer_steps_only_through_the_update():
    model, aset, _ = _model()
    update = OverlappedUpdate(aset.named_trainable(), CPU, model, lora_name)
    opt = build_optimizer(update.named_masters, OptimConfig(lr=1e-2))
    update.attach(opt)
    with pytest.raises(RuntimeError, match=r"update.step\(optimizer\)"):
        opt.step()


def test_a_failing_worker_raises_in_the_main_thread(monkeypatch):
    model, aset, _ = _model()
    update = OverlappedUpdate(aset.named_trainable(), CPU, model, lora_name)
    opt = build_optimizer(update.named_masters, OptimConfig(lr=1e-2))
    update.attach(opt)
    model(*_inputs(0, 0)).float().square().mean().backward()
    update.finish_backward()

    def broken(self, k, chunk):
        raise OSError("disk on fire")
    monkeypatch.setattr(OverlappedUpdate, "_push", broken)
    update.step(opt)
    with pytest.raises(RuntimeError, match="overlapped host update failed") as info:
        model(*_inputs(1, 0))  # the first gate
    assert isinstance(info.value.__cause__, OSError)
    update.wait()  # raised once, then clear


def test_the_snapshot_keeps_the_learning_rate_it_was_taken_with():
    _, named = _trained(full=True)
    opt = build_optimizer(named, OptimConfig(name="muon", lr=1e-2))
    assert hasattr(opt, "optimizers")  # Muon and AdamW, combined
    view = overlap.snapshot(opt)
    for g in opt.param_groups:
        g["lr"] = 123.0
    assert all(g["lr"] != 123.0 for g in view.param_groups)
    assert all(v.state is o.state for v, o in zip(view.optimizers, opt.optimizers))  # shared
    some = {id(p) for _, p in named[:3]} | {id(named[-1][1])}  # a chunk's view: only its tensors
    part = overlap.snapshot(opt, some)
    assert {id(p) for g in part.param_groups for p in g["params"]} == some
    assert all(g["params"] for g in part.param_groups)  # no empty group reaches a fused kernel


@pytest.mark.gpu
@pytest.mark.parametrize("slow", [0.0, 0.02])
def test_on_cuda_the_overlapped_update_is_the_host_updates(monkeypatch, slow):
    """On the GPU: chunks pushed on a side stream, the forward's stream waiting on each
    chunk's event; the run is the plain host update's, bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run through the device machine)")
    from test_streaming import _deterministic

    cuda = torch.device("cuda", torch.cuda.current_device())
    with _deterministic():
        plain = _train(False, device=cuda)
        _same_run(plain, _train(True, device=cuda, slow=slow, monkeypatch=monkeypatch))
