"""Where a device optimizer's update runs (``kohakumoss/memory/stepping.py``): the step in
backward and the streamed states are the plain step's arithmetic bit for bit, free what
they say they free, and resume."""

from __future__ import annotations

import pytest
import torch

from kohakumoss.config import OptimConfig
from kohakumoss.memory import stepping
from kohakumoss.memory.stepping import FusedStep, StreamedStates
from kohakumoss.training.optim import build_optimizer, clip_and_check
from kohakumoss.formats.statefile import flatten_state

CPU = torch.device("cpu")


def _toy(seed=0):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    # named as a block's: muon takes the matrices, AdamW the biases
    return net, [(f"layers.0.{n}", p) for n, p in net.named_parameters()]


def _batches(steps, accum):
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(5, 6, generator=g) for _ in range(accum)] for _ in range(steps)]


def _trained(name, seed=0):
    net, named = _toy(seed)
    return net, named, build_optimizer(named, OptimConfig(name=name, lr=1e-2, weight_decay=0.1))


def _plain(name, data):
    net, named, opt = _trained(name)
    norms = []
    for micro in data:
        for x in micro:
            net(x).square().mean().backward()
        norms.append(clip_and_check([p for _, p in named], 0.0)[0])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return net, opt, norms


def _same(a, opt_a, b, opt_b):
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    (ta, sa), (tb, sb) = flatten_state(opt_a.state_dict()), flatten_state(opt_b.state_dict())
    assert sa == sb and ta.keys() == tb.keys() and ta
    assert all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_the_step_in_backward_is_the_plain_step_and_drops_each_gradient(name):
    data = _batches(3, 2)
    a, opt_a, norms_a = _plain(name, data)
    b, named, opt_b = _trained(name)
    fused = FusedStep(named, opt_b)
    norms_b = []
    for micro in data:
        for i, x in enumerate(micro):
            if i == len(micro) - 1:
                fused.arm()
            net_out = b(x).square().mean()
            net_out.backward()
            if i < len(micro) - 1:  # accumulating: nothing stepped yet
                assert all(p.grad is not None for _, p in named)
        assert all(p.grad is None for _, p in named)  # each dropped once stepped
        norms_b.append(fused.finish()[0])
    _same(a, opt_a, b, opt_b)
    assert norms_b == pytest.approx(norms_a, rel=1e-6)


def test_a_step_whose_last_micro_batch_had_no_sample_is_stepped_at_the_end():
    data = _batches(2, 1)
    a, opt_a, _ = _plain("adamw", data)
    b, named, opt_b = _trained("adamw")
    fused = FusedStep(named, opt_b)
    for micro in data:
        b(micro[0]).square().mean().backward()  # landed before the step was armed
        fused.arm()  # the last micro-batch: nothing usable, no backward
        norm, finite = fused.finish()
        assert finite and norm > 0
    _same(a, opt_a, b, opt_b)


def test_a_non_finite_gradient_is_reported():
    net, named = _toy()
    fused = FusedStep(named, build_optimizer(named, OptimConfig(name="adamw", lr=1e-2)))
    fused.arm()
    (net(torch.full((2, 6), float("inf"))).sum() * 0).backward()
    assert fused.finish()[1] is False


@pytest.mark.parametrize("group", [2**23, 30], ids=["one group", "groups of 30"])
@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_streamed_states_are_the_device_optimizers_and_live_in_their_buffers(name, group, monkeypatch):
    """Bit for bit, whether the tensors step in one group or in several (groups of up to 30
    elements here: the 48-element matrix alone, then 8, then 24 and 3)."""
    monkeypatch.setattr(stepping, "STATE_GROUP_NUMEL", group)
    data = _batches(3, 2)
    a, opt_a, _ = _plain(name, data)
    b, named, opt_b = _trained(name)
    streamed = StreamedStates(named, opt_b, CPU)
    for micro in data:
        for x in micro:
            b(x).square().mean().backward()
        streamed.step()
        opt_b.zero_grad(set_to_none=True)
        for _, p in named:  # every tensor state between steps is the engine's buffer
            state = streamed._state(p)[p]
            buffers = streamed.host[id(p)]
            assert buffers and all(state[k] is v for k, v in buffers.items())
    _same(a, opt_a, b, opt_b)
    assert streamed.host_bytes() > 0
    sizes = [[p.numel() for p in g] for g in streamed.groups([p for _, p in named])]
    assert sizes == ([[48, 8, 24, 3]] if group > 100 else [[48], [8], [24, 3]])


def test_streamed_states_resume_from_a_saved_state():
    data = _batches(4, 1)
    a, opt_a, _ = _plain("adamw", data)
    b, named, opt_b = _trained("adamw")
    streamed = StreamedStates(named, opt_b, CPU)
    for micro in data[:2]:
        b(micro[0]).square().mean().backward()
        streamed.step()
        opt_b.zero_grad(set_to_none=True)
    saved, weights = opt_b.state_dict(), {k: v.clone() for k, v in b.state_dict().items()}
    c, named_c, opt_c = _trained("adamw", seed=5)  # a fresh process: other weights until loaded
    c.load_state_dict(weights)
    resumed = StreamedStates(named_c, opt_c, CPU)
    opt_c.load_state_dict(saved)
    for _, p in named_c:  # the loaded states went back to the engine's buffers
        assert all(resumed._state(p)[p][k] is v for k, v in resumed.host[id(p)].items())
    for micro in data[2:]:
        c(micro[0]).square().mean().backward()
        resumed.step()
        opt_c.zero_grad(set_to_none=True)
    _same(a, opt_a, c, opt_c)


@pytest.mark.gpu
def test_streamed_states_on_cuda_hold_no_state_on_the_device_between_steps():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    ref = torch.nn.Linear(1024, 1024).to(dev)
    net = torch.nn.Linear(1024, 1024).to(dev)
    net.load_state_dict(ref.state_dict())
    opt_a = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    opt_b = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)
    streamed = StreamedStates(list(net.named_parameters()), opt_b, dev)
    x = torch.randn(64, 1024, device=dev)
    for _ in range(3):
        ref(x).square().mean().backward()
        opt_a.step()
        opt_a.zero_grad(set_to_none=True)
        net(x).square().mean().backward()
        streamed.step()
        opt_b.zero_grad(set_to_none=True)
        for p in net.parameters():
            assert all(v.device.type == "cpu" and v.is_pinned() for k, v in opt_b.state[p].items()
                       if k != "step")
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), net.parameters()))


@pytest.mark.parametrize("placement, name", [
    ("fused", "adamw"), ("streamed", "adamw"), ("fused", "adafactor"), ("streamed", "adafactor"),
    ("fused", "adamw8bit")])  # the placements each optimizer takes (optimizers.OPTIMIZERS)
def test_a_run_trains_what_the_device_optimizer_trains_and_resumes(tmp_path, placement, name):
    """4 steps (accumulation 2, dropout, EMA, no clipping) with the step in backward or the
    streamed states: the device optimizer's weights, EMA and optimizer state at step 4, bit
    for bit; resumed from the device run's step-2 checkpoint it ends the same (one format);
    and resumed from its own step-2 checkpoint it writes its own step-4 checkpoint. (Rank 64
    for the 8-bit states: factors of 4,096 values and more are quantized.)"""
    import shutil

    from kohakumoss.memory.profiles import MemoryEngines
    from kohakumoss.params import load_params
    from kohakumoss.precision import precision_policy
    from kohakumoss.formats import checkpoint as ckpt_mod
    from kohakumoss.training.build import RunPaths, build_components
    from kohakumoss.training.engines import EnginePlan
    from kohakumoss.training.trainer import Trainer
    from test_train import _prepare, _same_checkpoints, _write_params
    from conftest import make_kohya

    plan = lambda optimizer: EnginePlan(CPU, precision_policy("fp32", full=False),  # noqa: E731
                                        memory=MemoryEngines("none", optimizer=optimizer))
    ds = make_kohya(tmp_path / "ds", {"2_a": [(48, 32), (32, 48), (40, 40)], "1_b": [(64, 32)]})
    params = _write_params(tmp_path, ds, train={"steps": 4, "checkpoint_every": 2, "grad_accum": 2},
                           adapter={"algo": "lora", "dim": 64 if name == "adamw8bit" else 4,
                                    "alpha": 4, "dropout": 0.1},
                           optim={"name": name, "lr": 3e-3, "ema": 0.9, "grad_clip": 0})
    p, paths = load_params(params), _prepare(tmp_path, params)
    run = lambda name, optimizer: (  # noqa: E731
        RunPaths(paths.plan, paths.catalog, paths.text_cache, paths.latent_cache, tmp_path / "runs" / name),
        optimizer)
    device, mine = run("device", "device"), run("mine", placement)
    for where, optimizer in (device, mine):
        trainer = Trainer(p, where, build_components(p, where, plan(optimizer)))
        assert trainer.stepper.kind == optimizer
        if optimizer == "fused":  # every tensor stepped inside backward, none after
            fused = trainer.stepper.fused
            seen, finish = [], fused.finish
            fused.finish = lambda: (seen.append(len(fused.stepped)), finish())[1]
        trainer.run(progress=False)
        if optimizer == "fused":
            assert seen == [len(fused.params)] * 4

    def same_training(a, b):
        ca, cb = ckpt_mod.open_checkpoint(a), ckpt_mod.open_checkpoint(b)
        ta, tb = ca.trainable(), cb.trainable()
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
        assert all(torch.equal(v, cb.ema()[k]) for k, v in ca.ema().items())
        xa, xb = flatten_state(ca.extra()), flatten_state(cb.extra())
        assert xa[1] == xb[1] and all(torch.equal(xa[0][k], xb[0][k]) for k in xa[0])

    same_training(device[0].checkpoints / "step-000004", mine[0].checkpoints / "step-000004")
    if name == "adamw8bit":  # its 8-bit states, saved as plain codes
        saved = flatten_state(ckpt_mod.open_checkpoint(mine[0].checkpoints / "step-000004").extra())[0]
        assert any(k.endswith("/codes") and saved[k].dtype == torch.uint8 for k in saved)
    for source, name in ((device[0], "from-device"), (mine[0], "from-own")):
        resumed = run(name, placement)[0]
        shutil.copytree(source.checkpoints / "step-000002", resumed.checkpoints / "step-000002")
        again = Trainer(p, resumed, build_components(p, resumed, plan(placement)))
        assert again.run(progress=False).start_step == 2
        same_training(mine[0].checkpoints / "step-000004", resumed.checkpoints / "step-000004")
        if source is mine[0]:
            _same_checkpoints(mine[0].checkpoints / "step-000004", resumed.checkpoints / "step-000004")
