"""``parallel.mode: threaded``: one process, the joint blocks split over several devices
(``kohakumoss/parallel/split.py``). On the CPU both stages are the host: the run goes through
the split's placement and its hand-overs, and must train what one device trains, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kohakumoss.configlib import ConfigError
from kohakumoss.params import parse_params
from kohakumoss.parallel.split import StageCosts, apply_device_split, plan_split, split_devices
from kohakumoss.training.build import RunPaths, build_components
from kohakumoss.training.trainer import Trainer

from conftest import make_kohya
from test_train import _prepare, _same_checkpoints, _write_params

GiB = 2**30
CARDS = (torch.device("cuda", 0), torch.device("cuda", 1))


def _fill(split) -> float:
    return max(p / f for p, f in zip(split.peaks, split.free))


def test_the_split_follows_each_cards_free_memory():
    """42 blocks over a 12 GB and an 11 GB card: contiguous stages covering every block, the
    first card (which also holds the rest of the model and the loss) taking fewer, and no
    other contiguous split leaving more room on the fullest card."""
    per = int(0.4 * GiB)
    costs = StageCosts(per_block=(per,) * 42, first=3 * GiB, other=GiB // 2)
    free = (12 * GiB, 11 * GiB)
    split = plan_split(costs, CARDS, free)
    assert split.fits
    a, b = split.stages
    assert a.start == 0 and a.stop == b.start and b.stop == 42 and len(a) < len(b)
    assert split.peaks == (3 * GiB + len(a) * per, GiB // 2 + len(b) * per)
    best = min(max((3 * GiB + k * per) / free[0], (GiB // 2 + (42 - k) * per) / free[1])
               for k in range(1, 42))
    assert _fill(split) == pytest.approx(best)
    text = split.describe()
    assert "cuda:0: blocks 0-" in text and "cuda:1: blocks" in text and "head" in text

    tight = plan_split(StageCosts((GiB,) * 42, 3 * GiB, GiB // 2), CARDS, free)  # 45 GiB on 23
    assert not tight.fits and sum(len(s) for s in tight.stages) == 42
    three = plan_split(costs, (*CARDS, torch.device("cuda", 2)), (8 * GiB, 8 * GiB, 8 * GiB))
    assert [len(s) for s in three.stages] and all(len(s) >= 1 for s in three.stages)
    assert sum(len(s) for s in three.stages) == 42 and three.fits
    # partial checkpointing: the first 20 blocks keep only their inputs (a quarter of a
    # block's share): the first card takes more of them
    mixed = StageCosts((per // 4,) * 20 + (per,) * 22, 3 * GiB, GiB // 2)
    m = plan_split(mixed, CARDS, (12 * GiB, 12 * GiB))
    assert m.fits and len(m.stages[0]) > 21
    assert m.peaks[0] == 3 * GiB + sum(mixed.per_block[:len(m.stages[0])])


def test_the_devices_of_a_threaded_run():
    cpu = torch.device("cpu")
    assert split_devices((), cpu) == (cpu, cpu)  # two stages on the host
    assert split_devices(("cpu", "cpu"), cpu) == (cpu, cpu)
    with pytest.raises(ValueError, match=r"parallel.devices\[0\] = 'cpu' is not train.device"):
        split_devices(("cpu", "cpu"), torch.device("meta"))


def test_threaded_params_are_checked_when_they_load():
    data = {"datasets": [{"source": "kohya", "path": "x"}]}

    def params(**parallel):
        return parse_params({"data": data, "parallel": {"mode": "threaded", **parallel}}, "p.yaml")

    assert params().parallel.mode == "threaded"
    with pytest.raises(ConfigError, match=r"parallel.world_size = 2 .*one process drives every device"):
        params(world_size=2)
    with pytest.raises(ConfigError, match=r"parallel.devices = \['cuda:0'\] .*two or more devices"):
        params(devices=["cuda:0"])
    with pytest.raises(ConfigError, match=r"parallel.devices = \['cuda:3'"):
        params(devices=["cuda:3"])
    with pytest.raises(ConfigError, match=r"parallel.devices = \['cuda:1', 'cuda:0'\] .*first device is train.device"):
        parse_params({"data": data, "parallel": {"mode": "threaded", "devices": ["cuda:1", "cuda:0"]},
                      "train": {"device": "cuda"}}, "p.yaml")
    with pytest.raises(ConfigError, match=r"first device is train.device \(cpu\)"):
        parse_params({"data": data, "parallel": {"mode": "threaded", "devices": ["cuda:0", "cuda:1"]},
                      "train": {"device": "cpu"}}, "p.yaml")
    with pytest.raises(ConfigError, match=r"parallel.devices = \('gpu0', 'gpu1'\) is not allowed: a list of devices"):
        params(devices=["gpu0", "gpu1"])


@pytest.mark.parametrize("adapter", [{"algo": "lora", "dim": 4, "alpha": 4, "dropout": 0.1},
                                     {"algo": "full"}])
def test_a_threaded_run_trains_what_one_device_trains(tmp_path, adapter):
    """The split applied (both stages on the host), a LoRA and a full finetune: every
    checkpoint equals the one-device run's bit for bit, and the model carries the split."""
    ds = make_kohya(tmp_path / "ds", {"2_a": [(48, 32), (32, 48), (40, 40)], "1_b": [(64, 32)]})
    one = _write_params(tmp_path, ds, train={"steps": 4, "checkpoint_every": 2}, adapter=adapter)
    paths = _prepare(tmp_path, one)
    runs = {}
    for mode in ("auto", "threaded"):
        p = parse_params({**_raw(one), "parallel": {"mode": mode}}, str(one))
        here = RunPaths(paths.plan, paths.catalog, paths.text_cache, paths.latent_cache,
                        tmp_path / mode / p.run.name)
        c = build_components(p, here)
        split = c.model.engines.state("device split")
        assert (split is not None) == (mode == "threaded")
        if split is not None:
            lengths = [len(s) for s in split.stages]  # the tiny model's three joint blocks
            assert sum(lengths) == len(c.model.layers) == 3 and min(lengths) >= 1
        Trainer(p, here, c).run(progress=False)
        runs[mode] = here.checkpoints
    for step in ("step-000002", "step-000004"):
        _same_checkpoints(runs["auto"] / step, runs["threaded"] / step)


def _raw(path):
    import yaml

    raw = yaml.safe_load(path.read_text())
    return {k: v for k, v in raw.items() if v is not None}


def test_the_split_hands_the_stream_to_each_stage_and_back(monkeypatch):
    """The hand-overs of a forward: the first block of each later stage takes its inputs to
    its device and the last block hands the stream back to the first; the output is the
    unsplit model's, bit for bit (both stages on the host)."""
    from kohakumoss.model import FLAVORS, build_layout
    from kohakumoss.model.build import random_transformer
    from kohakumoss.parallel import split as split_mod
    from kohakumoss.parallel.split import Split

    cpu = torch.device("cpu")
    model = random_transformer(FLAVORS["tiny"], cpu)
    depth, c = len(model.layers), model.config
    assert depth >= 2
    layout = build_layout([(4, 4), (2, 6)], [5, 3])
    g = torch.Generator().manual_seed(0)
    img = torch.randn(layout.n_img, c.latent_channels, generator=g)
    text = torch.randn(8, c.text_dim, generator=g)
    sigma = torch.rand(2, generator=g)
    with torch.no_grad():
        want = model(img, text, sigma, layout)
    moves = []
    real = split_mod._moved

    def spy(value, device):
        if isinstance(value, torch.Tensor):
            moves.append(device)
        return real(value, device)

    monkeypatch.setattr(split_mod, "_moved", spy)
    split = Split((cpu, cpu), (range(0, 1), range(1, depth)), (0, 0), (1, 1))
    handle = apply_device_split(model, split)
    assert model.engines.wrapped_parts(model.layers[1]) == ("forward",)
    assert model.engines.runs_whole(model.layers[-1]) and not model.engines.runs_whole(model.layers[0])
    with torch.no_grad():
        got = model(img, text, sigma, layout)
    assert torch.equal(got, want)
    assert len(moves) >= 4  # the stream, modulation, segments and RoPE angles went over
    model.engines.remove(handle)
    assert not model.engines.runs_whole(model.layers[1])
