"""The optimizers of well-kept libraries (torchao's 8-bit AdamW, Prodigy, schedule-free AdamW,
torch's Adafactor): each trains the tiny model, saves its state without pickle, resumes
bit for bit (a SIGKILL in the middle of a run included), is refused where it cannot run,
and the memory estimator's figure for its state is the state's own tensor bytes."""

from __future__ import annotations

import dataclasses
import signal
import time

import pytest
import torch
import yaml
from safetensors.torch import load_file

from kohakumoss.config import OptimConfig
from kohakumoss.configlib import ConfigError
from kohakumoss.formats import checkpoint as ckpt_mod
from kohakumoss.formats.statefile import dumps_state, flatten_state, loads_state, unflatten_state
from kohakumoss.model.dit import REPEATED
from kohakumoss.params import load_params
from kohakumoss.training.build import RunPaths
from kohakumoss.training.optim import build_optimizer, build_scheduler
from kohakumoss.optimizers import OPTIMIZERS, state_bytes
from kohakumoss.training.trainer import Trainer

from test_train import _prepare, _run_cli, _same_checkpoints, _write_params, small  # noqa: F401

NEW = ("adamw8bit", "prodigy", "schedulefree", "adafactor")
LR = {"adamw8bit": 3e-2, "prodigy": 1.0, "schedulefree": 3e-2, "adafactor": 3e-2}


def _named() -> list[tuple[str, torch.nn.Parameter]]:
    """A LoRA's shapes and the rest: matrices big enough for the 8-bit states (>= 4,096
    values), a small one kept in fp32, a vector, a 3-D tensor (Adafactor's factors)."""
    g = torch.Generator().manual_seed(0)
    shapes = {"layers.0.attn.lora_down.weight": (16, 512), "layers.0.attn.lora_up.weight": (512, 16),
              "layers.0.attn.small.weight": (8, 16), "norm.weight": (48,),
              "conv.weight": (4, 8, 16)}
    return [(n, torch.nn.Parameter(torch.randn(s, generator=g) * 0.1)) for n, s in shapes.items()]


def _steps(named, opt, sched, steps: range) -> list[float]:
    """Fit every tensor to a fixed random target: the loss of each step."""
    out = []
    for s in steps:
        target = torch.Generator().manual_seed(1000)
        loss = sum(((p - torch.randn(p.shape, generator=target)) ** 2).mean() for _, p in named)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        out.append(float(loss.detach()))
    return out


def _saved(opt) -> dict:
    """The optimizer's state through the checkpoint format: tensors and JSON, no pickle."""
    tensors, tree = flatten_state(opt.state_dict())
    assert all(type(t) is torch.Tensor for t in tensors.values())
    return unflatten_state(loads_state(dumps_state(tree)), {k: t.clone() for k, t in tensors.items()})


@pytest.mark.parametrize("name", NEW)
def test_each_optimizer_trains_and_resumes_bit_for_bit_through_the_plain_format(name):
    cfg = dataclasses.replace(OptimConfig(), name=name, lr=LR[name], weight_decay=0.01)

    def fresh():
        named = _named()
        opt = build_optimizer(named, cfg)
        return named, opt, build_scheduler(opt, cfg, 8)

    named, opt, sched = fresh()
    whole = _steps(named, opt, sched, range(8))
    assert whole[-1] < whole[0], whole  # it trains (Prodigy from its small first estimate)
    end = [p.detach().clone() for _, p in named]

    named, opt, sched = fresh()
    first = _steps(named, opt, sched, range(4))
    weights, state, schedule = [p.detach().clone() for _, p in named], _saved(opt), sched.state_dict()
    named, opt, sched = fresh()
    with torch.no_grad():
        for (_, p), w in zip(named, weights):
            p.copy_(w)
    opt.load_state_dict(state)
    sched.load_state_dict(schedule)
    rest = _steps(named, opt, sched, range(4, 8))
    assert first + rest == whole
    assert all(torch.equal(p, e) for (_, p), e in zip(named, end))


@pytest.mark.parametrize("name", ["adamw", "muon", *NEW])
def test_the_estimators_state_figure_is_the_states_tensor_bytes(name):
    named = _named()
    cfg = dataclasses.replace(OptimConfig(), name=name, lr=LR.get(name, 1e-3))
    opt = build_optimizer(named, cfg, block_prefixes=REPEATED)
    _steps(named, opt, build_scheduler(opt, cfg, 2), range(1))
    tensors, _ = flatten_state(opt.state_dict())  # (torchao keeps a group's lr as a 0-d tensor)
    real = sum(t.numel() * t.element_size() for k, t in tensors.items() if "param_groups" not in k)
    assert state_bytes(name, [(n, tuple(p.shape)) for n, p in named], REPEATED) == real
    if name == "adamw8bit":  # the big matrices' moments at ~1 byte a value
        assert real < 0.4 * state_bytes("adamw", [(n, tuple(p.shape)) for n, p in named])


def _params(tmp, ds, name: str, **over):
    sections = {"optim": {"name": name, "lr": LR[name], **over.pop("optim", {})},
                "train": {"steps": 8, "checkpoint_every": 4, "keep_checkpoints": 4,
                          **over.pop("train", {})}}
    top = {k: over.pop(k) for k in [k for k, v in over.items() if not isinstance(v, dict)]}
    path = _write_params(tmp, ds, **sections, **over)
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **top}))
    return path


RUNS = {  # each on what it is for in 24 tiny steps: the 8-bit states need tensors of >= 4,096
    # values (a full finetune's); Adafactor's relative step needs non-zero weights (a LoRA's up
    # factors start at zero); Prodigy's first estimate is small (d_coef speeds it up here)
    "adamw8bit": dict(adapter={"algo": "full"}, optim={"lr": 1e-3}),
    "prodigy": dict(optim={"lr": 1.0, "prodigy_d_coef": 100.0}),
    "schedulefree": dict(optim={"lr": 3e-2}),
    "adafactor": dict(adapter={"algo": "full"}, optim={"lr": 1e-2}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", NEW)
def test_a_run_with_each_optimizer_learns_and_resumes_after_sigkill(small, name):  # noqa: F811
    tmp, ds = small
    params = _params(tmp, ds, name, train={"steps": 24, "checkpoint_every": 8}, **RUNS[name])
    paths = _prepare(tmp, params)
    straight = RunPaths(paths.plan, paths.catalog, paths.text_cache, paths.latent_cache, tmp / "a" / "default")
    killed = RunPaths(paths.plan, paths.catalog, paths.text_cache, paths.latent_cache, tmp / "b" / "default")
    out = _run_cli(params, straight)
    log = out.communicate(timeout=600)[0].decode()
    assert out.returncode == 0, log
    proc = _run_cli(params, killed)
    deadline = time.time() + 600
    while not (killed.checkpoints / "step-000008").is_dir():
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read().decode()
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 24 not in [c.step for c in ckpt_mod.list_checkpoints(killed.checkpoints)]
    again = _run_cli(params, killed)
    log = again.communicate(timeout=600)[0].decode()
    assert again.returncode == 0, log
    _same_checkpoints(straight.checkpoints / "step-000024", killed.checkpoints / "step-000024")
    last = ckpt_mod.open_checkpoint(straight.checkpoints / "step-000024")
    losses = [r["loss"] for r in last.log()["metrics"] if "loss" in r]
    assert len(losses) == 24 and sum(losses[-8:]) < 0.9 * sum(losses[:8]), losses  # it learns
    assert {f.suffix for f in last.path.iterdir()} == {".json", ".safetensors"}  # no pickle


def test_schedule_free_evaluates_and_exports_the_averaged_weights(small):  # noqa: F811
    """Previews, validation and the checkpoint's trained tensors are the average x; the
    training sequence y comes back bit for bit after each, so they do not change training."""
    tmp, ds = small
    params = _params(tmp, ds, "schedulefree", train={"steps": 4, "checkpoint_every": 4})
    paths = _prepare(tmp, params)
    trainer = Trainer(load_params(params), paths)
    trainer.run(progress=False)
    stepper = trainer.stepper
    assert stepper.kind == "averaged"
    y = [t.detach().clone() for t in stepper.tensors]
    with stepper.evaluating():
        x = {k: v.detach().clone() for k, v in trainer.trainable.state_dict().items()}
        assert any(not torch.equal(a, b) for a, b in zip(stepper.tensors, y))
    assert all(torch.equal(a, b) for a, b in zip(stepper.tensors, y))
    saved = load_file(str(paths.checkpoints / "step-000004" / "trainable.safetensors"))
    assert saved.keys() == x.keys() and all(torch.equal(saved[k], x[k].float()) for k in x)


@pytest.mark.parametrize("name, over, match", [
    ("schedulefree", {"optim": {"ema": 0.9}}, "optim.ema = 0.9 with optim.name: schedulefree: it averages"),
    ("schedulefree", {"optim": {"schedule": "cosine"}}, "optim.schedule = cosine .* replaces the decay"),
    ("schedulefree", {"profile": "manual", "memory": {"optimizer": "host"}}, "memory.optimizer = host"),
    ("prodigy", {"profile": "manual", "memory": {"optimizer": "fused"}, "optim": {"grad_clip": 0}},
     "memory.optimizer = fused with optim.name: prodigy: its step size is one estimate"),
    ("prodigy", {"optim": {"lr": 0}}, "optim.lr = 0.0 with optim.name: prodigy"),
    ("adamw8bit", {"profile": "manual", "memory": {"optimizer": "streamed"}}, "tensor subclasses"),
    ("adafactor", {"adapter": {"algo": "full"}, "parallel": {"world_size": 2}},
     "parallel.world_size = 2 .* row and column factors"),
])
def test_what_an_optimizer_cannot_run_with_is_refused_with_the_reason(small, name, over, match):  # noqa: F811
    tmp, ds = small
    params = _params(tmp, ds, name, **over)
    with pytest.raises(ConfigError, match=match):
        load_params(params)


def test_a_profile_placement_an_optimizer_refuses_becomes_the_device_one(small):  # noqa: F811
    from kohakumoss.memory.profiles import MemoryEngines
    from kohakumoss.training.estimate import placed

    tmp, ds = small
    p = load_params(_params(tmp, ds, "schedulefree"))
    engines, note = placed(MemoryEngines("block", optimizer="host"), p, torch.device("cuda"))
    assert engines.optimizer == "device" and "schedulefree runs on the device" in note
    assert set(OPTIMIZERS) >= {"adamw", "muon", *NEW}
