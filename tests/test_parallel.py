"""Data-parallel training on the CPU: torchrun, gloo, two processes (docs/parallel.md).

Two ranks train what one process trains over the same plan (each global batch's draws are
keyed by the batch, not by who runs it): the same checkpoints to fp32 round-off. A rank
killed mid-run, then `kmoss train` again, ends bit-identical to an uninterrupted two-rank
run, and a resume on another process count is refused with what it needs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from kohakumoss.configlib import ConfigError
from kohakumoss.params import load_params
from kohakumoss.parallel import Dist, launch_command, reduce_gradients
from kohakumoss.formats import checkpoint as ckpt_mod
from kohakumoss.training.build import RunPaths, build_components
from kohakumoss.training.trainer import Trainer

from conftest import make_kohya
from test_train import _prepare, _same_checkpoints, _write_params

KMOSS = Path(sys.executable).with_name("kmoss")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """A plan for two ranks (dropout and text drop on, so the draws matter), its caches."""
    tmp = tmp_path_factory.mktemp("parallel")
    ds = make_kohya(tmp / "ds", {"2_a": [(48, 32), (32, 48), (40, 40)], "1_b": [(64, 32), (32, 32)]})
    params = _write_params(tmp, ds, train={"steps": 4, "checkpoint_every": 2, "keep_checkpoints": 3},
                           adapter={"algo": "lora", "dim": 4, "alpha": 4, "dropout": 0.1},
                           parallel={"world_size": 2}, kernels={"table": "off"},
                           data={"num_workers": 0})
    paths = _prepare(tmp, params)
    return tmp, params, paths


def _torchrun(tmp: Path, params: Path, paths: RunPaths, runs: str, kill: str | None = None):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.pop("KMOSS_KILL_AT", None)
    if kill:
        env["KMOSS_KILL_AT"] = kill
    return subprocess.run([str(KMOSS), "train", "--params", str(params), "--plan", str(paths.plan),
                           "--catalog", str(paths.catalog), "--text-cache", str(paths.text_cache),
                           "--latent-cache", str(paths.latent_cache), "--kernels", str(tmp / "nokernels"),
                           "--runs", str(tmp / runs)], capture_output=True, text=True, env=env, cwd=tmp)


def _torchrun_resuming(tmp: Path, params: Path, paths: RunPaths, runs: str):
    """``_torchrun``, run once more where a rank died by SIGSEGV. gloo on the CPU (the tests'
    stand-in for NCCL) crashed so once in a CI run of the sharded full finetune (2026-12-05;
    not reproduced in 16 runs under load). The tool's answer to a dead rank is to run again,
    which resumes from the newest checkpoint bit for bit (the killed-rank case below holds
    that), so the rerun is the run a user would make, and it must succeed."""
    res = _torchrun(tmp, params, paths, runs)
    if res.returncode != 0 and "(SIGSEGV)" in res.stdout + res.stderr:
        warnings.warn(f"a rank crashed natively (SIGSEGV); resumed:\n{res.stderr[-2000:]}")
        res = _torchrun(tmp, params, paths, runs)
    return res


def _one_process(tmp: Path, params: Path, paths: RunPaths, runs: str) -> Path:
    p = load_params(params)
    here = RunPaths(paths.plan, paths.catalog, paths.text_cache, paths.latent_cache, tmp / runs / p.run.name)
    Trainer(p, here, build_components(p, here)).run(progress=False)
    return here.checkpoints


def test_two_ranks_train_what_one_process_trains(two_ranks):
    tmp, params, paths = two_ranks
    res = _torchrun_resuming(tmp, params, paths, "two")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "torch.distributed.run" in res.stderr and "--nproc-per-node=2" in res.stderr
    name = load_params(params).run.name
    two = tmp / "two" / name / "checkpoints"
    one = _one_process(tmp, params, paths, "one")
    for step in ("step-000002", "step-000004"):
        a, b = ckpt_mod.open_checkpoint(two / step), ckpt_mod.open_checkpoint(one / step)
        ta, tb = a.trainable(), b.trainable()
        assert ta.keys() == tb.keys()
        for k in ta:  # the ranks' gradients summed by an all-reduce: fp32 round-off
            torch.testing.assert_close(ta[k], tb[k], rtol=1e-5, atol=1e-7)
        assert a.state["processes"] == 2 and b.state["processes"] == 1
    # and a resume on another count is refused, naming what it needs
    p = load_params(params)
    moved = RunPaths(paths.plan, paths.catalog, paths.text_cache, paths.latent_cache, tmp / "two" / name)
    trainer = Trainer(p, moved, build_components(p, moved))
    with pytest.raises(ConfigError, match="written by a run of 2 process\\(es\\) and this one has 1"):
        trainer.resume()


def test_a_rank_killed_mid_run_resumes_to_the_uninterrupted_run(two_ranks):
    tmp, params, paths = two_ranks
    name = load_params(params).run.name
    if not (tmp / "two" / name / "checkpoints" / "step-000004").is_dir():
        assert _torchrun(tmp, params, paths, "two").returncode == 0
    killed = _torchrun(tmp, params, paths, "killed", kill="train.step:3@1")  # rank 1, after step 3
    assert killed.returncode != 0 and "a rank failed" in killed.stdout + killed.stderr
    ckpts = tmp / "killed" / name / "checkpoints"
    assert [c.path.name for c in ckpt_mod.list_checkpoints(ckpts)][-1] == "step-000002"
    again = _torchrun(tmp, params, paths, "killed")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resuming from" in again.stderr
    # against the uninterrupted run of the same mode (two ranks): tensors and metric rows
    _same_checkpoints(ckpts / "step-000004", tmp / "two" / name / "checkpoints" / "step-000004")
    assert _metric_rows(ckpts / "step-000004") == _metric_rows(tmp / "two" / name / "checkpoints" / "step-000004")


def _metric_rows(checkpoint: Path) -> list[dict]:
    """The metric rows a checkpoint persists, less what depends on the machine (``TIMING``)."""
    from kohakumoss.training.metrics import TIMING, rows_of

    rows = rows_of(ckpt_mod.open_checkpoint(checkpoint).load().log)
    assert rows and rows[-1]["step"] == 4
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def test_a_finished_run_of_other_params_is_set_aside_by_rank_0_alone(two_ranks):
    """A new experiment over a finished two-rank run (``dvc exp run -S ...`` after a run):
    rank 0 alone judges the newest checkpoint and moves the old run to ``history/``, before
    the barrier; rank 1 then reads what it left (nothing) and never moves a checkpoint. Rank
    1 used to read the checkpoint rank 0 was moving, call it damaged and fail moving it to
    ``corrupt/`` (2 of 3 tries). Twice, each starting fresh to the same checkpoints."""
    import shutil

    import yaml

    tmp, params, paths = two_ranks
    name = load_params(params).run.name
    if not (tmp / "two" / name / "checkpoints" / "step-000004").is_dir():
        assert _torchrun(tmp, params, paths, "two").returncode == 0
    raw = yaml.safe_load(params.read_text())
    raw["optim"]["lr"] = raw["optim"]["lr"] * 2  # another experiment of the same plan
    other = tmp / "other.yaml"
    other.write_text(yaml.safe_dump(raw))
    ends = []
    for attempt in range(2):
        shutil.rmtree(tmp / "exp", ignore_errors=True)
        shutil.copytree(tmp / "two", tmp / "exp")
        res = _torchrun(tmp, other, paths, "exp")
        assert res.returncode == 0, res.stdout + res.stderr
        run = tmp / "exp" / name
        assert "resuming from" not in res.stderr and not (run / "corrupt").exists()
        assert [c.path.name for c in ckpt_mod.list_checkpoints(next((run / "history").iterdir()))] == \
            ["step-000002", "step-000004"]  # the old run, whole
        ends.append(ckpt_mod.open_checkpoint(run / "checkpoints" / "step-000004").trainable())
    assert all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])


@pytest.fixture(scope="module")
def two_ranks_full(tmp_path_factory):
    """A full finetune planned for two ranks (AdamW, an EMA), its caches."""
    tmp = tmp_path_factory.mktemp("parallel_full")
    ds = make_kohya(tmp / "ds", {"2_a": [(48, 32), (32, 48), (40, 40)], "1_b": [(64, 32), (32, 32)]})
    params = _write_params(tmp, ds, train={"steps": 4, "checkpoint_every": 2, "keep_checkpoints": 3},
                           adapter={"algo": "full"}, optim={"lr": 1e-3, "ema": 0.9},
                           parallel={"world_size": 2}, kernels={"table": "off"}, data={"num_workers": 0})
    return tmp, params, _prepare(tmp, params)


@pytest.mark.slow  # ~1 min: two ranks and one process train, then compare
def test_a_sharded_full_finetune_trains_what_one_process_trains(two_ranks_full):
    """FSDP2 over two ranks: the whole-model checkpoints rank 0 writes equal one process's
    to fp32 round-off (weights and EMA), load in one process like any full finetune's, and a
    rank killed mid-run resumes to the uninterrupted run bit for bit."""
    tmp, params, paths = two_ranks_full
    res = _torchrun_resuming(tmp, params, paths, "two")
    assert res.returncode == 0, res.stdout + res.stderr
    name = load_params(params).run.name
    two = tmp / "two" / name / "checkpoints"
    one = _one_process(tmp, params, paths, "one")
    for step in ("step-000002", "step-000004"):
        a, b = ckpt_mod.open_checkpoint(two / step), ckpt_mod.open_checkpoint(one / step)
        a.verify()
        ta, tb = a.trainable(), b.trainable()
        assert ta.keys() == tb.keys() and len(ta) > 20  # every weight, whole
        for k in ta:
            torch.testing.assert_close(ta[k], tb[k], rtol=1e-5, atol=1e-6)
        ea, eb = a.ema(), b.ema()
        for k in ea:
            torch.testing.assert_close(ea[k], eb[k], rtol=1e-5, atol=1e-6)
    killed = _torchrun(tmp, params, paths, "killed", kill="train.step:3@1")
    assert killed.returncode != 0
    again = _torchrun(tmp, params, paths, "killed")
    assert again.returncode == 0, again.stdout + again.stderr
    _same_checkpoints(tmp / "killed" / name / "checkpoints" / "step-000004", two / "step-000004")


@pytest.mark.slow  # ~1 min: a replicated full finetune on two ranks, one process, a refused resume
def test_a_full_finetune_under_ddp_trains_what_one_process_trains(two_ranks_full):
    """``parallel.mode: ddp`` for a full finetune: every rank the whole model, the gradients
    summed (no sharding): the checkpoints equal one process's to fp32 round-off, record
    the mode, and a resume under ``fsdp`` is refused naming the mode it needs."""
    import yaml

    tmp, params, paths = two_ranks_full
    raw = yaml.safe_load(params.read_text())
    raw["parallel"]["mode"] = "ddp"
    ddp = tmp / "ddp.yaml"
    ddp.write_text(yaml.safe_dump(raw))
    res = _torchrun_resuming(tmp, ddp, paths, "ddp")
    assert res.returncode == 0, res.stdout + res.stderr
    name = load_params(ddp).run.name
    got = tmp / "ddp" / name / "checkpoints"
    one = tmp / "one" / name / "checkpoints"
    if not (one / "step-000004").is_dir():
        one = _one_process(tmp, params, paths, "one")
    for step in ("step-000002", "step-000004"):
        a, b = ckpt_mod.open_checkpoint(got / step), ckpt_mod.open_checkpoint(one / step)
        assert a.state["parallel"] == "ddp" and b.state["parallel"] == "single"
        ta, tb = a.trainable(), b.trainable()
        assert ta.keys() == tb.keys() and len(ta) > 20
        for k in ta:
            torch.testing.assert_close(ta[k], tb[k], rtol=1e-5, atol=1e-6)
    raw["parallel"]["mode"] = "fsdp"  # the same run otherwise: it would resume this one
    fsdp = tmp / "fsdp.yaml"
    fsdp.write_text(yaml.safe_dump(raw))
    refused = _torchrun(tmp, fsdp, paths, "ddp")
    assert refused.returncode != 0
    assert "written under parallel.mode ddp and this run is fsdp" in refused.stdout + refused.stderr


def test_parallel_mode_resolves_and_refuses_what_cannot_work():
    """``parallel.mode``: auto is fsdp for a full finetune over ranks and ddp for an adapter;
    fsdp with an adapter is refused when params load, with the reason; a replicated full
    finetune (ddp) takes Muon, which the sharded one refuses."""
    from kohakumoss.params import parse_params
    from kohakumoss.parallel import parallel_mode

    def params(**sections):
        return parse_params({"data": {"datasets": [{"source": "kohya", "path": "x"}]}, **sections},
                            "params.yaml")

    two = {"world_size": 2}
    assert parallel_mode(params()) == "single"
    assert parallel_mode(params(parallel=two)) == "ddp"
    assert parallel_mode(params(parallel=two, adapter={"algo": "full"})) == "fsdp"
    assert parallel_mode(params(parallel={**two, "mode": "ddp"}, adapter={"algo": "full"})) == "ddp"
    with pytest.raises(ConfigError, match=r"parallel.mode.*fsdp.*ddp or auto with an adapter \(FSDP2 shards"):
        params(parallel={**two, "mode": "fsdp"})
    with pytest.raises(ConfigError, match="Newton-Schulz.*or parallel.mode: ddp"):
        params(parallel=two, adapter={"algo": "full"}, optim={"name": "muon"})
    assert parallel_mode(params(parallel={**two, "mode": "ddp"}, adapter={"algo": "full"},
                                optim={"name": "muon"})) == "ddp"
    with pytest.raises(ConfigError, match="parallel.mode"):
        params(parallel={**two, "mode": "pipeline"})  # not built yet: not a mode there is


def test_reduce_gradients_sums_over_ranks_in_buckets(tmp_path, monkeypatch):
    """Gradients of mixed sizes, over two gloo processes, with buckets smaller than the
    tensors: each rank ends with the sum."""
    import torch.multiprocessing as mp

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29500 + os.getpid() % 1000))
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_reduce_worker, args=(str(out),), nprocs=2, join=True)
    got = [torch.load(out / f"{r}.pt") for r in (0, 1)]
    want = [sum(_grads(r)[i] for r in (0, 1)) for i in range(3)]
    for g in got:
        assert all(torch.equal(a, b) for a, b in zip(g, want))


def _grads(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(s, generator=g) for s in ((5, 3), (7,), (2, 2, 2))]


def _reduce_worker(rank: int, out: str) -> None:
    import torch.distributed as dist

    import kohakumoss.parallel as par

    dist.init_process_group("gloo", rank=rank, world_size=2)
    par.BUCKET_BYTES = 40  # smaller than every tensor: one bucket each
    ts = [torch.zeros_like(g, requires_grad=True) for g in _grads(rank)]
    for t, g in zip(ts, _grads(rank)):
        t.grad = g.clone()
    reduce_gradients(ts, Dist(rank, 2))
    torch.save([t.grad for t in ts], Path(out) / f"{rank}.pt")
    dist.destroy_process_group()


def test_the_all_reduce_overlaps_the_last_backward_to_the_same_sums(tmp_path, monkeypatch):
    """``GradientReducer`` with ``overlap`` (the device stepper's): over two gloo processes
    and two accumulated micro-batches, buckets start their all-reduce inside the last
    backward (none inside the first), and the sums are the non-overlapped reducer's bit for
    bit: each rank's gradients summed; a tensor no backward reached keeps no gradient."""
    import torch.multiprocessing as mp

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(28500 + os.getpid() % 1000))
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_overlap_worker, args=(str(out),), nprocs=2, join=True)
    got = [torch.load(out / f"{r}.pt") for r in (0, 1)]
    local = [g["local"] for g in got]
    for g in got:
        (plain, launched_plain), (overlapped, launched) = g["runs"]
        assert launched_plain == 0 and launched >= 2, (launched_plain, launched)
        assert plain[0] is None and overlapped[0] is None  # the unused tensor
        for a, b, l0, l1 in zip(plain[1:], overlapped[1:], local[0][1:], local[1][1:]):
            assert torch.equal(a, b) and torch.equal(a, l0 + l1)


def _overlap_worker(rank: int, out: str) -> None:
    import torch.distributed as dist
    from torch import nn

    import kohakumoss.parallel as par

    dist.init_process_group("gloo", rank=rank, world_size=2)
    par.BUCKET_BYTES = 600  # a few buckets: the linears' weights and biases apart
    runs, local = [], None
    for overlap in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        unused = nn.Parameter(torch.zeros(3))
        tensors = [unused, *model.parameters()]  # with the first linear: the bucket that waits
        reducer = par.GradientReducer(tensors, Dist(rank, 2), overlap=overlap)
        g = torch.Generator().manual_seed(rank)
        for micro in range(2):
            if micro == 1:
                reducer.arm()
            model(torch.randn(5, 8, generator=g)).square().sum().backward()
            if micro == 0:
                assert reducer.launched_in_backward == 0
        local = [t.grad.clone() if t.grad is not None else None for t in tensors]
        launched = reducer.launched_in_backward
        reducer.finish()
        reducer.remove()
        runs.append(([t.grad.clone() if t.grad is not None else None for t in tensors], launched))
    torch.save({"runs": runs, "local": local}, Path(out) / f"{rank}.pt")
    dist.destroy_process_group()


def test_the_host_update_sums_the_ranks_gradients(tmp_path, monkeypatch):
    """The optimizer on the host (``memory.optimizer: host``) over two gloo processes: each
    rank's gradients land in its host buffers, the masters' gradients are summed over the
    ranks (what the trainer does after a step's last micro-batch), and both ranks step to
    what one process steps to on the two ranks' losses summed, bit for bit on the CPU."""
    import torch.multiprocessing as mp

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29500 + (os.getpid() + 7) % 1000))
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_host_worker, args=(str(out),), nprocs=2, join=True)
    model, opt = _host_model()
    sum(_host_loss(model, r) for r in (0, 1)).backward()
    opt.step()
    want = [p.detach() for p in model.parameters()]
    for r in (0, 1):
        got = torch.load(out / f"{r}.pt")
        assert all(torch.equal(a, b) for a, b in zip(got["params"], want))
        assert all(torch.equal(a, b) for a, b in zip(got["masters"], want))


def _host_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _host_loss(model: torch.nn.Module, rank: int) -> torch.Tensor:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 + rank))
    return model(x).square().mean()


def _host_worker(rank: int, out: str) -> None:
    import torch.distributed as dist

    from kohakumoss.memory.host_update import HostUpdate

    dist.init_process_group("gloo", rank=rank, world_size=2)
    model, _ = _host_model()
    update = HostUpdate(list(model.named_parameters()), torch.device("cpu"))
    opt = torch.optim.AdamW([m for _, m in update.named_masters], lr=1e-2)
    update.attach(opt)
    _host_loss(model, rank).backward()
    update.finish_backward()
    assert all(p.grad is None for p in model.parameters())  # the gradients left for the host
    reduce_gradients(update.masters, Dist(rank, 2))
    update.step(opt)
    torch.save({"params": [p.detach() for p in model.parameters()], "masters": update.masters},
               Path(out) / f"{rank}.pt")
    dist.destroy_process_group()


def test_a_node_streams_the_base_from_one_shared_host_copy(tmp_path, monkeypatch):
    """Weight streaming over two gloo processes with ``NodeCopies``: the first rank writes the
    host copies into one shared file, the other maps it and writes nothing; both train the
    resident model's loss and LoRA gradients bit for bit; a byte one rank writes the other
    reads (one copy, not two); the file is gone once both mapped it."""
    import torch.multiprocessing as mp

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29500 + (os.getpid() + 13) % 1000))
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_copies_worker, args=(str(out),), nprocs=2, join=True)
    from test_streaming import _model, _step

    want_out, want_grads = _step(*_model()[:2])
    for r in (0, 1):
        got = torch.load(out / f"{r}.pt")
        assert torch.equal(got["out"], want_out)
        assert all(torch.equal(got["grads"][n], g) for n, g in want_grads.items())
        assert got["seen"] == 7.0 and got["unlinked"]
    assert not list(out.glob("*.weights"))


def _copies_worker(rank: int, out: str) -> None:
    import sys

    import torch.distributed as dist

    from kohakumoss.memory.host_copies import NodeCopies
    from kohakumoss.memory.streaming import apply_weight_streaming

    sys.path.insert(0, str(Path(__file__).parent))
    import test_streaming

    dist.init_process_group("gloo", rank=rank, world_size=2)
    copies = NodeCopies("test", rank == 0, dist.barrier, pin=False, root=out)
    test_streaming.apply_weight_streaming = lambda *a, **k: apply_weight_streaming(*a, **k, copies=copies)
    model, aset, ring = test_streaming._model(stream=2)
    assert ring.copies is copies
    dist.barrier()  # the leader unlinks the file after done()'s barrier: let it get there
    unlinked = not os.path.exists(copies.path)
    result = test_streaming._step(model, aset)
    first = ring.host[0]
    dist.barrier()
    old = float(first[0])
    if rank == 0:
        first[0] = 7.0
    dist.barrier()
    seen = float(first[0])
    dist.barrier()
    if rank == 0:
        first[0] = old
    torch.save({"out": result[0], "grads": result[1], "seen": seen, "unlinked": unlinked},
               Path(out) / f"{rank}.pt")
    dist.destroy_process_group()


def _fsdp_model():
    from kohakumoss.model.build import tiny_transformer

    return tiny_transformer()


def _fsdp_loss(model, rank: int, device: torch.device) -> torch.Tensor:
    from kohakumoss.model import FLAVORS, build_layout

    g = torch.Generator().manual_seed(20 + rank)
    c = FLAVORS["tiny"]
    layout = build_layout([(3, 4), (2, 5)], [4, 6])
    img = torch.randn(layout.n_img, c.latent_channels, generator=g)
    txt = torch.randn(layout.n_txt, c.text_dim, generator=g)
    sigma = torch.rand(2, generator=g)
    return model(img.to(device), txt.to(device), sigma.to(device), layout.to(device)).square().mean()


def _fsdp_steps(model, ranks: list[int], device: torch.device, steps: int = 2) -> None:
    """AdamW steps on the mean of ``ranks``' losses (FSDP2 averages the ranks' gradients)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        (sum(_fsdp_loss(model, r, device) for r in ranks) / len(ranks)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _fsdp_worker(rank: int, out: str) -> None:
    import sys

    import torch.distributed as dist

    from kohakumoss.memory import repeated_blocks
    from kohakumoss.parallel.fsdp import model_state, shard_model

    sys.path.insert(0, str(Path(__file__).parent))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = _fsdp_model()
    blocks = [b for _, b in repeated_blocks(model)]
    shard_model(model, blocks, torch.device("cpu"), 2, offload=True)
    for unit in (model, *blocks):  # every unit keeps its shard on the host
        assert type(unit._get_fsdp_state()._fsdp_param_group.offload_policy).__name__ == "CPUOffloadPolicy"
    _fsdp_steps(model, [rank], torch.device("cpu"))
    state = model_state(model)
    if rank == 0:
        torch.save(state, Path(out) / "sharded.pt")
    dist.destroy_process_group()


def test_a_sharded_full_finetune_with_host_offload_trains_what_one_process_trains(tmp_path, monkeypatch):
    """FSDP2 with the masters, gradients and AdamW states of each rank's shard on the host
    (``shard_model(offload=True)``, what ``low`` / ``minimal`` become for a sharded full
    finetune), two gloo processes: two steps give one process's weights on the mean of the
    two ranks' losses, to fp32 round-off."""
    import torch.multiprocessing as mp

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29500 + (os.getpid() + 29) % 1000))
    mp.spawn(_fsdp_worker, args=(str(tmp_path),), nprocs=2, join=True)
    model = _fsdp_model()
    _fsdp_steps(model, [0, 1], torch.device("cpu"))
    got, want = torch.load(tmp_path / "sharded.pt"), model.state_dict()
    assert got.keys() == want.keys()
    changed = 0
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)
        changed += not torch.equal(v, _fsdp_model().state_dict()[k])
    assert changed > 20  # the steps moved the weights


@pytest.mark.gpu
def test_host_offloaded_shards_train_on_cuda(monkeypatch):
    """One NCCL rank on the GPU: FSDP2 with its shard on the host (page-locked), the blocks
    gathered onto the device, the buffers moved there: the plain GPU model's weights after
    two AdamW steps, to fp32 round-off."""
    import torch.distributed as dist

    from kohakumoss.memory import repeated_blocks
    from kohakumoss.parallel.fsdp import model_state, shard_model

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29500 + (os.getpid() + 31) % 1000))
    cuda = torch.device("cuda", 0)
    torch.backends.cuda.matmul.allow_tf32 = False
    plain = _fsdp_model().to(cuda)
    _fsdp_steps(plain, [0], cuda)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        model = _fsdp_model()
        shard_model(model, [b for _, b in repeated_blocks(model)], cuda, 1, offload=True)
        assert all(p.to_local().device.type == "cpu" and p.to_local().is_pinned() for p in model.parameters())
        _fsdp_steps(model, [0], cuda)
        got = model_state(model)
    finally:
        dist.destroy_process_group()
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(got[k].to(cuda), v, rtol=1e-4, atol=1e-5)


def test_more_ranks_than_this_machine_has_devices_is_a_clear_error():
    from kohakumoss.params import parse_params
    from kohakumoss.parallel import device_problem

    p = parse_params({"data": {"datasets": [{"source": "kohya", "path": "x"}]},
                      "parallel": {"world_size": 4, "nodes": 2}}, "params.yaml")
    assert device_problem(p, "cuda", 2) is None and device_problem(p, "cpu", 0) is None
    problem = device_problem(p, "cuda", 1)
    assert "puts 2 ranks on this machine, which has 1 CUDA device(s)" in problem
    assert "at most 2" in problem


def test_the_launch_command():
    from kohakumoss.params import parse_params

    p = parse_params({"data": {"datasets": [{"source": "kohya", "path": "x"}]},
                      "parallel": {"world_size": 4}}, "params.yaml")
    cmd = launch_command(p, ["--params", "params.yaml"])
    assert cmd[1:6] == ["-m", "torch.distributed.run", "--nproc-per-node=4", "--nnodes=1", "--standalone"]
    assert cmd[-4:] == ["stages.cli", "train", "--params", "params.yaml"]
    p = parse_params({"data": {"datasets": [{"source": "kohya", "path": "x"}]},
                      "parallel": {"world_size": 4, "nodes": 2, "rdzv_endpoint": "node0:29400"}}, "params.yaml")
    cmd = launch_command(p, [])
    assert "--nproc-per-node=2" in cmd and "--rdzv-endpoint=node0:29400" in cmd and "--standalone" not in cmd
    p = parse_params({"data": {"datasets": [{"source": "kohya", "path": "x"}]},
                      "parallel": {"world_size": 4, "nodes": 2}}, "params.yaml")
    with pytest.raises(ConfigError, match="parallel.rdzv_endpoint"):
        launch_command(p, [])
