"""Params that cannot train what they say are refused when they load, before any stage does
work: a wrong adapter combination, targets that match nothing, missing or wrong weights, and
knobs that parse but that nothing honours yet (parallel.world_size > 1, train.dtype fp16)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from kohakumoss.configlib import ConfigError
from kohakumoss.params import load_params
from stages.cli import app

from conftest import ROOT

runner = CliRunner()


def _params(tmp: Path, **sections) -> Path:
    """The shipped params.yaml with ``sections`` merged in, its dataset and weight paths made
    absolute."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["data"]["datasets"][0]["path"] = str(ROOT / "examples" / "dataset")
    for key in ("transformer", "text_encoder", "vae"):
        raw["model"][key] = str(ROOT / raw["model"][key])
    raw["caption"]["tokenizer"] = str(ROOT / raw["caption"]["tokenizer"])
    for name, values in sections.items():
        if isinstance(values, dict):
            raw.setdefault(name, {}).update(values)
        else:  # a top-level key (profile)
            raw[name] = values
    path = tmp / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


REFUSED = {
    "oft input dropout": ({"adapter": {"algo": "oft", "dropout": 0.1}}, ["adapter", "dropout"]),
    "dora on ia3": ({"adapter": {"algo": "ia3", "dora": True}}, ["adapter.dora", "ia3"]),
    "tlora merged": ({"adapter": {"algo": "tlora", "mode": "merge"}}, ["T-LoRA", "bypass"]),
    "bad preset": ({"adapter": {"preset": "attn+nothing"}}, ["preset", "attn+nothing"]),
    "bad regex": ({"adapter": {"targets": ["layers.(0"]}}, ["adapter.targets", "regular expression"]),
    "dead target": ({"adapter": {"targets": ["layers\\.0\\.proj\\.qq"]}},
                    ["adapter", "match no module", "layers.N.proj.q"]),
    "norms only": ({"adapter": {"targets": ["final_norm_video"], "train_norms": True}},
                   ["select no linear"]),
    "missing transformer": ({"model": {"transformer": "/nonexistent/moss/transformer"}},
                            ["model.transformer", "does not exist"]),
    "transformer not safetensors": ({"model": {"transformer": "README.md"}},
                                    ["model.transformer", ".safetensors"]),
    "missing text encoder": ({"model": {"text_encoder": "/nonexistent/qwen"}},
                             ["model.text_encoder", "does not exist"]),
    "missing vae": ({"model": {"vae": "/nonexistent/vae"}}, ["model.vae", "does not exist"]),
    "caption tokenizer": ({"caption": {"tokenizer": "/nonexistent/tok"}},
                          ["caption.tokenizer", "not a folder"]),
    "two ranks of a Muon full finetune": ({"parallel": {"world_size": 2}, "adapter": {"algo": "full"},
                                           "optim": {"name": "muon"}},
                                          ["parallel.world_size", "optim.name: muon", "whole matrices",
                                           "optim.name: adamw"]),
    "fp16 training without loss scaling": ({"train": {"dtype": "fp16"}, "precision": {"loss_scale": "off"}},
                                           ["train.dtype", "loss scaling", "precision.loss_scale: auto", "bf16"]),
    "a stream scale not a power of two": ({"precision": {"stream_scale": 0.3}},
                                          ["precision.stream_scale", "power of two"]),
    "renamed sampler": ({"objective": {"sampler": "uniform"}}, ["objective.timesteps"]),
    "unknown profile": ({"profile": "fast"}, ["profile", "'fast'", "speed, balanced, low, minimal, auto, manual"]),
    "memory knob beside a profile": ({"profile": "speed", "memory": {"checkpointing": "block"}},
                                     ["memory.checkpointing = 'block'", "profile: speed", "profile: manual"]),
    "partial without blocks": ({"profile": "manual", "memory": {"checkpointing": "partial"}},
                               ["memory.checkpoint_blocks", "checkpointing: partial"]),
    "blocks without partial": ({"profile": "manual", "memory": {"checkpointing": "block", "checkpoint_blocks": 3}},
                               ["memory.checkpoint_blocks = 3", "partial only"]),
    "unknown checkpointing": ({"profile": "manual", "memory": {"checkpointing": "blocks"}},
                              ["memory.checkpointing", "'blocks'"]),
    "streaming a full finetune with a device optimizer": (
        {"profile": "manual", "adapter": {"algo": "full"},
         "memory": {"checkpointing": "block", "stream_slots": 2}},
        ["memory.stream_slots", "full finetune", "set memory.optimizer: host"]),
    "negative slots": ({"profile": "manual", "memory": {"stream_slots": -1}},
                       ["memory.stream_slots", "an integer >= 0"]),
    "offload without block checkpointing": ({"profile": "manual", "memory": {"checkpointing": "selective", "offload": True}},
                                            ["memory.offload", "checkpointing: selective", "set checkpointing: block or sub-block"]),
    "rebuild with block checkpointing": ({"profile": "manual", "memory": {"checkpointing": "block", "rebuild": True}},
                                         ["memory.rebuild", "checkpointing: block", "checkpointing: none or partial"]),
    "unknown optimizer placement": ({"profile": "manual", "memory": {"optimizer": "gpu"}},
                                    ["memory.optimizer", "'gpu'", "device", "host", "fused", "streamed"]),
    "the step in backward with clipping": ({"profile": "manual", "memory": {"optimizer": "fused"}},
                                           ["memory.optimizer = 'fused'", "optim.grad_clip = 1.0",
                                            "global norm", "set optim.grad_clip: 0"]),
    "the step in backward with fp16": ({"profile": "manual", "memory": {"optimizer": "fused"},
                                        "optim": {"grad_clip": 0}, "train": {"dtype": "fp16"}},
                                       ["memory.optimizer = 'fused'", "train.dtype: fp16", "bf16"]),
    "the step in backward on two ranks": ({"profile": "manual", "memory": {"optimizer": "fused"},
                                           "optim": {"grad_clip": 0}, "parallel": {"world_size": 2}},
                                          ["memory.optimizer = 'fused'", "parallel.world_size = 2",
                                           "summed after backward"]),
    "streamed states of a sharded full finetune": ({"profile": "manual", "memory": {"optimizer": "streamed"},
                                                    "adapter": {"algo": "full"}, "parallel": {"world_size": 2}},
                                                   ["memory.optimizer = 'streamed'", "FSDP2 shards",
                                                    "device or host"]),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_when_params_load(tmp_path, case):
    sections, needles = REFUSED[case]
    path = _params(tmp_path, **sections)
    with pytest.raises(ConfigError) as err:
        load_params(path)
    for needle in needles:
        assert needle in str(err.value), str(err.value)
    assert str(path) in str(err.value)  # the message names the file


@pytest.mark.parametrize("case", ["oft input dropout", "dead target", "missing transformer",
                                  "two ranks of a Muon full finetune", "fp16 training without loss scaling",
                                  "memory knob beside a profile"])
def test_the_first_stage_refuses_before_any_work(tmp_path, case):
    """`kmoss scan` (the first stage of `dvc repro`) stops with one error line and exit 2,
    having written nothing: no catalog, no artifacts folder."""
    sections, needles = REFUSED[case]
    path = _params(tmp_path, **sections)
    work = tmp_path / "work"
    work.mkdir()
    cwd = os.getcwd()
    os.chdir(work)
    try:
        res = runner.invoke(app, ["scan", "--params", str(path)])
    finally:
        os.chdir(cwd)
    assert res.exit_code == 2, res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in res.output, res.output
    for needle in needles:
        assert needle in res.output.replace("\n", " ") or needle in errors[0], res.output
    assert list(work.iterdir()) == []


def test_the_accepted_neighbours_still_load(tmp_path):
    """The refusals are exact: the same knobs one step inside what is honoured load."""
    for sections in ({"adapter": {"algo": "oft", "rank_dropout": 0.1}},
                     {"adapter": {"algo": "lokr", "dora": True}},
                     {"adapter": {"algo": "tlora", "mode": "bypass"}},
                     {"adapter": {"targets": ["layers\\.0\\.proj\\.q"]}},
                     {"adapter": {"algo": "full", "dropout": 0.5}},
                     {"parallel": {"world_size": 1}}, {"parallel": {"world_size": 2}},
                     {"parallel": {"world_size": 2}, "adapter": {"algo": "full"}},
                     {"parallel": {"world_size": 2}, "profile": "low"},  # adapters: the host update reduces
                     {"parallel": {"world_size": 2}, "profile": "low", "adapter": {"algo": "full"}},  # FSDP2 offload
                     {"train": {"dtype": "fp32"}}, {"train": {"dtype": "fp16"}},
                     {"objective": {"timesteps": "uniform"}},
                     {"profile": "minimal"},
                     {"profile": "manual", "memory": {"checkpointing": "partial", "checkpoint_blocks": 2}},
                     {"profile": "manual", "memory": {"checkpointing": "block", "stream_slots": 3,
                                                      "optimizer": "host", "offload": True}},
                     {"profile": "manual", "adapter": {"algo": "full"},
                      "memory": {"checkpointing": "block", "stream_slots": 2, "optimizer": "host"}},
                     {"profile": "auto", "memory": {"checkpointing": "none", "recompute": True}},
                     {"profile": "manual", "memory": {"optimizer": "fused"}, "optim": {"grad_clip": 0}},
                     {"profile": "manual", "memory": {"optimizer": "streamed"},
                      "parallel": {"world_size": 2}}):
        load_params(_params(tmp_path, **sections))
    p = load_params(_params(tmp_path, profile="manual", memory={"checkpointing": "sub-block"}))
    assert p.profile == "manual" and p.memory.checkpointing == "sub-block"
