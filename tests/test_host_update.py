"""The optimizer on the host (``memory.optimizer: host``): gradients leave the device as
backward makes them, the update runs on host masters; on the CPU the arithmetic is the
device optimizer's bit for bit, a run resumes across placements, and the device keeps no
gradient."""

from __future__ import annotations

import shutil

import pytest
import torch

from kohakumoss.config import OptimConfig
from kohakumoss.memory.host_update import HostUpdate
from kohakumoss.memory.profiles import MemoryEngines
from kohakumoss.precision import precision_policy
from kohakumoss.training.engines import EnginePlan
from kohakumoss.training.optim import build_optimizer, clip_and_check
from kohakumoss.formats.statefile import flatten_state

CPU = torch.device("cpu")


def _toy(seed=0):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    # named as a block's: muon takes the matrices, AdamW the biases
    return net, [(f"layers.0.{n}", p) for n, p in net.named_parameters()]


def _train(host: bool, steps=3, accum=2, name="adamw"):
    net, named = _toy()
    update = HostUpdate(named, CPU) if host else None
    stepped = update.named_masters if update else named
    opt = build_optimizer(stepped, OptimConfig(name=name, lr=1e-2, weight_decay=0.1))
    if update:
        update.attach(opt)
    g = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(steps):
        for _ in range(accum):
            net(torch.randn(5, 6, generator=g)).square().mean().backward()
            if update:
                update.finish_backward()
                assert all(p.grad is None for _, p in named)  # the device keeps no gradient
        norms.append(clip_and_check([t for _, t in stepped], 0.5)[0])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return net, opt, norms


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_the_host_update_is_the_device_optimizers_arithmetic_on_the_cpu(name):
    a, opt_a, norms_a = _train(False, name=name)
    b, opt_b, norms_b = _train(True, name=name)
    assert norms_a == norms_b
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    (ta, sa), (tb, sb) = flatten_state(opt_a.state_dict()), flatten_state(opt_b.state_dict())
    assert sa == sb and ta.keys() == tb.keys() and ta
    assert all(torch.equal(ta[k], tb[k]) for k in ta)


def test_a_first_gradient_is_its_landing_buffer_and_the_next_lands_in_the_spare():
    """No host copy of a first micro-batch's gradient: its landing buffer becomes the
    master's gradient, the previous gradient's buffer takes the next landing, and a second
    micro-batch adds into the gradient (the arithmetic: the test above)."""
    net, named = _toy()
    update = HostUpdate(named, CPU)
    x = torch.randn(5, 6)
    seen = []
    for _ in range(3):
        net(x).square().mean().backward()
        landed = [s.data_ptr() for s in update.staging]
        update.finish_backward()
        grads = [m.grad for m in update.masters]
        assert [g.data_ptr() for g in grads] == landed  # taken, not copied
        first = [g.clone() for g in grads]
        net(x).square().mean().backward()  # a second micro-batch: the spare, then added
        assert all(s.data_ptr() not in landed for s in update.staging)
        update.finish_backward()
        assert all(torch.equal(m.grad, 2 * f) for m, f in zip(update.masters, first))
        assert [m.grad.data_ptr() for m in update.masters] == landed
        seen.append(landed)
        for m in update.masters:
            m.grad = None  # as a step's zero_grad
    assert seen[0] != seen[1] and seen[0] == seen[2]  # two buffers per tensor, alternating


def test_masters_follow_a_loaded_state_and_skip_tensors_without_gradient():
    net, named = _toy()
    update = HostUpdate(named, CPU)
    with torch.no_grad():
        for _, p in named:
            p.add_(1.0)
    update.load({})  # a state without these names: the parameters as they are
    assert all(torch.equal(m, p) for m, (_, p) in zip(update.masters, named))
    net[2](torch.randn(2, 8)).sum().backward()  # only the last layer gets a gradient
    update.finish_backward()
    got = [m.grad is not None for m in update.masters]
    assert got == [False, False, True, True]


def _lean(stream=2, resident=0):
    return EnginePlan(CPU, precision_policy("fp32", full=False),
                      memory=MemoryEngines("block", stream_slots=stream, optimizer="host",
                                           resident_blocks=resident))


@pytest.mark.parametrize("name", ["adamw", "adafactor"])  # those the host update takes
def test_a_run_resumes_across_placements_bit_for_bit(tmp_path, name):
    """4 steps with the lean engines (streamed base, host update) equal 2 steps with the
    device optimizer followed by 2 resumed with the lean engines: one checkpoint format
    (every optimizer the host update takes: ``optimizers.OPTIMIZERS``)."""
    from kohakumoss.memory import repeated_blocks
    from kohakumoss.params import load_params
    from kohakumoss.training.build import RunPaths, build_components
    from kohakumoss.training.trainer import Trainer
    from test_train import _prepare, _same_checkpoints, _write_params
    from conftest import make_kohya

    ds = make_kohya(tmp_path / "ds", {"2_a": [(48, 32), (32, 48), (40, 40)], "1_b": [(64, 32)]})
    params = _write_params(tmp_path, ds, train={"steps": 4, "checkpoint_every": 2, "grad_accum": 2},
                           adapter={"algo": "lora", "dim": 4, "alpha": 4, "dropout": 0.1},
                           optim={"name": name, "lr": 3e-3, "ema": 0.9})
    p, paths = load_params(params), _prepare(tmp_path, params)
    lean = Trainer(p, paths, build_components(p, paths, _lean()))
    from kohakumoss.memory.overlap import OverlappedUpdate

    assert lean.stepper.kind == "host" and isinstance(lean.stepper.host, OverlappedUpdate)  # beside the forward
    assert lean.run(progress=False).start_step == 0
    other = RunPaths(paths.plan, paths.catalog, paths.text_cache, paths.latent_cache, tmp_path / "runs" / "b")
    plain = Trainer(p, other, build_components(p, other, EnginePlan(CPU, precision_policy("fp32", full=False))))
    assert plain.stepper.kind == "device"
    plain.run(progress=False)
    _same_checkpoints(paths.checkpoints / "step-000004", other.checkpoints / "step-000004")
    resumed = RunPaths(paths.plan, paths.catalog, paths.text_cache, paths.latent_cache, tmp_path / "runs" / "c")
    shutil.copytree(other.checkpoints / "step-000002", resumed.checkpoints / "step-000002")
    again = Trainer(p, resumed, build_components(p, resumed, _lean(stream=1, resident=2)))
    assert len(again.model.engines.state("weight streaming").units) == len(repeated_blocks(again.model)) - 2
    assert again.run(progress=False).start_step == 2
    _same_checkpoints(paths.checkpoints / "step-000004", resumed.checkpoints / "step-000004")


PROFILES_ON_CUDA = {  # what each profile runs on a CUDA device, forced here on the CPU
    "speed": MemoryEngines("none", fp8_transposes=True),  # the transposes: fp8 compute full only
    "balanced": MemoryEngines("none", rebuild=True),
    "low": MemoryEngines("block", stream_slots=4, optimizer="host", offload=True),
    "minimal": MemoryEngines("sub-block", stream_slots=2, optimizer="host", offload=True),
}


@pytest.mark.parametrize("profile", sorted(PROFILES_ON_CUDA))
def test_a_resumed_run_equals_an_uninterrupted_one_under_every_profile(tmp_path, profile):
    """Killed after step 2 (its checkpoint kept), resumed under the same engines: the step-4
    checkpoint is the uninterrupted run's, bit for bit."""
    from kohakumoss.memory.profiles import PROFILE_ENGINES
    from kohakumoss.params import load_params
    from kohakumoss.training.build import RunPaths, build_components
    from kohakumoss.training.trainer import Trainer
    from test_train import _prepare, _same_checkpoints, _write_params
    from conftest import make_kohya

    memory = PROFILES_ON_CUDA[profile]
    assert PROFILE_ENGINES[profile] == memory  # the table above is the profiles' own
    plan = lambda: EnginePlan(CPU, precision_policy("fp32", full=False), memory=memory)  # noqa: E731
    ds = make_kohya(tmp_path / "ds", {"2_a": [(48, 32), (32, 48), (40, 40)], "1_b": [(64, 32)]})
    params = _write_params(tmp_path, ds, train={"steps": 4, "checkpoint_every": 2, "grad_accum": 2},
                           adapter={"algo": "lora", "dim": 4, "alpha": 4, "dropout": 0.1},
                           optim={"lr": 3e-3, "ema": 0.9})
    p, paths = load_params(params), _prepare(tmp_path, params)
    Trainer(p, paths, build_components(p, paths, plan())).run(progress=False)
    resumed = RunPaths(paths.plan, paths.catalog, paths.text_cache, paths.latent_cache, tmp_path / "runs" / "resumed")
    shutil.copytree(paths.checkpoints / "step-000002", resumed.checkpoints / "step-000002")
    assert Trainer(p, resumed, build_components(p, resumed, plan())).run(progress=False).start_step == 2
    _same_checkpoints(paths.checkpoints / "step-000004", resumed.checkpoints / "step-000004")


@pytest.mark.parametrize("offload", [False, True], ids=["block", "block-offload"])
def test_a_streamed_full_finetune_is_the_resident_one_bit_for_bit(tmp_path, offload):
    """A full finetune whose block matrices stream in bf16 (fp32 masters, gradients and
    AdamW on the host; with ``offload`` the blocks' kept inputs and attention outputs on the
    host too, ``low``'s engines) computes what the resident fp32-master autocast run
    computes: the same values meet the same kernels. Resumed from the resident run's step-2
    checkpoint it writes that run's step-4 checkpoint (masters, not bf16 copies), bit for bit."""
    from kohakumoss.params import load_params
    from kohakumoss.training.build import RunPaths, build_components
    from kohakumoss.training.trainer import Trainer
    from test_train import _prepare, _same_checkpoints, _write_params
    from conftest import make_kohya

    ds = make_kohya(tmp_path / "ds", {"2_a": [(48, 32), (32, 48), (40, 40)], "1_b": [(64, 32)]})
    params = _write_params(tmp_path, ds, train={"steps": 4, "checkpoint_every": 2, "dtype": "bf16",
                                                "grad_accum": 2},
                           adapter={"algo": "full"}, optim={"lr": 1e-3, "ema": 0.9, "grad_clip": 0.5})
    p, paths = load_params(params), _prepare(tmp_path, params)
    policy = precision_policy("bf16", full=True)
    plain = Trainer(p, paths, build_components(p, paths, EnginePlan(CPU, policy))).run(progress=False)
    streamed_plan = EnginePlan(CPU, policy, memory=MemoryEngines("block", stream_slots=2, optimizer="host",
                                                                 offload=offload))
    other = RunPaths(paths.plan, paths.catalog, paths.text_cache, paths.latent_cache, tmp_path / "runs" / "s")
    c = build_components(p, other, streamed_plan)
    ring = c.model.engines.state("weight streaming")
    assert ring.dtype == torch.bfloat16 and all(p.dtype == torch.float32 for p in c.stepper.host.masters)
    streamed = Trainer(p, other, c).run(progress=False)
    assert streamed.losses == plain.losses
    _same_checkpoints(paths.checkpoints / "step-000004", other.checkpoints / "step-000004")
    resumed = RunPaths(paths.plan, paths.catalog, paths.text_cache, paths.latent_cache, tmp_path / "runs" / "t")
    shutil.copytree(paths.checkpoints / "step-000002", resumed.checkpoints / "step-000002")
    assert Trainer(p, resumed, build_components(p, resumed, streamed_plan)).run(progress=False).start_step == 2
    _same_checkpoints(paths.checkpoints / "step-000004", resumed.checkpoints / "step-000004")


@pytest.mark.gpu
def test_a_streamed_full_finetune_on_cuda_gives_the_resident_gradients():
    """On the GPU: block matrices streamed in bf16 through 2 slots, gradients landing on the
    host as backward makes them; their fp32 sums equal the resident autocast run's
    gradients bit for bit (deterministic kernels)."""
    import dataclasses

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kohakumoss.memory.streaming import apply_weight_streaming
    from kohakumoss.model import FLAVORS, MOSSImageTransformer, build_layout
    from test_streaming import _deterministic

    c = dataclasses.replace(FLAVORS["tiny"], dim=512, heads=4, ffn_dim=2048, depth=4, text_blocks=2)
    cuda = torch.device("cuda", torch.cuda.current_device())

    def run(stream: bool):
        torch.manual_seed(0)
        m = MOSSImageTransformer(c)
        with torch.no_grad():
            for name, p in m.named_parameters():
                p.normal_(0, 0.02).add_(1.0 if "norm" in name else 0.0)
        m.requires_grad_(True)
        named = list(m.named_parameters())
        update = None
        if stream:
            update = HostUpdate(named, cuda)
            apply_weight_streaming(m, cuda, 2, trainable=True, dtype=torch.bfloat16)
        else:
            m.cuda()
        g = torch.Generator().manual_seed(1)
        layout = build_layout([(16, 16), (12, 20)], [20, 30]).to(cuda)
        img = torch.randn(layout.n_img, c.latent_channels, generator=g).to(cuda)
        txt = torch.randn(layout.n_txt, c.text_dim, generator=g).to(cuda)
        sigma = torch.rand(2, generator=g).to(cuda)
        for _ in range(2):  # two micro-batches accumulate
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = m(img, txt, sigma, layout)
            out.float().square().mean().backward()
            if update:
                update.finish_backward()
        if update:
            return {n: mst.grad.clone() for n, mst in update.named_masters}
        return {n: p.grad.cpu() for n, p in named}

    with sdpa_kernel([SDPBackend.MATH]), _deterministic():
        a, b = run(False), run(True)
    assert a.keys() == b.keys()
    bad = [n for n in a if not torch.equal(a[n], b[n])]
    assert not bad, bad[:5]


def test_a_finished_host_update_frees_its_parameters_and_gradients():
    """The landing hooks live on the parameters (autograd's C++ side, out of the garbage
    collector's sight): they must not hold the update, or a dropped run's parameters, device
    gradients and masters stay alive (0.55 GiB a run for the published LoRA, measured)."""
    import gc
    import weakref

    net, named = _toy()
    update = HostUpdate(named, CPU)
    opt = build_optimizer(update.named_masters, OptimConfig(lr=1e-2))
    update.attach(opt)
    net(torch.randn(5, 6)).square().mean().backward()
    update.finish_backward()
    opt.step()
    alive = [weakref.ref(t) for _, t in named] + [weakref.ref(update)]
    del net, named, update, opt
    gc.collect()
    assert [r() for r in alive] == [None] * len(alive)
