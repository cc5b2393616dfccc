"""Exports from checkpoints and files: LyCORIS round trip, merged == bypass, diffusers reload,
full finetunes (and EMA), atomic replacement."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from kohakumoss.adapters import apply_adapters
from kohakumoss.config import AdapterConfig
from kohakumoss.params import parse_params
from kohakumoss.export.formats import ExportError, load_source, merged_state, write_export
from kohakumoss.model import build_layout
from kohakumoss.model.build import tiny_transformer
from kohakumoss.formats.comfy import load_adapter_file
from kohakumoss.formats.model_files import load_transformer
from kohakumoss.checks.parity import rel_error
from kohakumoss.formats.checkpoint import save_checkpoint

from conftest import ROOT, repo_params_raw

P = parse_params(repo_params_raw(), str(ROOT / "params.yaml"))


def _inputs():
    g = torch.Generator().manual_seed(0)
    hw, lens = [(3, 4), (2, 2)], [5, 3]
    return (torch.randn(16, 128, generator=g), torch.randn(8, 48, generator=g), torch.tensor([0.3, 0.8]),
            build_layout(hw, lens))


def _adapter_checkpoint(tmp_path, algo="lora", directory=None, step=7, **kw):
    cfg = AdapterConfig(algo=algo, dim=4, alpha=4, **kw)
    ad = apply_adapters(tiny_transformer(), cfg, seed=P.run.seed)
    g = torch.Generator().manual_seed(1)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() and v.ndim > 0
             else v for k, v in ad.state_dict().items()}
    trained = {"algo": algo, "preset": cfg.preset, "targets": [], "dim": 4, "alpha": 4.0, "dora": cfg.dora,
               "algo_kwargs": {}, "train_norms": False}
    return save_checkpoint(directory or tmp_path / "ck", step, state, {}, {"trained": trained, "steps": 7})


def _out(model, x):
    with torch.no_grad():
        return model(*x).double()


@pytest.mark.parametrize("algo", ["lora", "loha", "lokr"])
def test_lycoris_round_trip_and_merged_equals_bypass(tmp_path, algo):
    ck = _adapter_checkpoint(tmp_path, algo)
    src = load_source(P, ck)
    x = _inputs()
    trained = _out(src.model, x)
    assert rel_error(trained, _out(tiny_transformer().eval(), x)) > 1e-3  # the adapter matters
    lyco = write_export(src, "lycoris", tmp_path / "a.safetensors", dtype="fp32")
    fresh = tiny_transformer().eval()
    load_adapter_file(fresh, lyco)
    assert rel_error(_out(fresh, x), trained) < 1e-6
    merged = write_export(src, "merged", tmp_path / "m.safetensors", dtype="fp32")
    model, info = load_transformer(merged, dtype=torch.float32)
    assert info.fused_qkv and rel_error(_out(model.eval(), x), trained) < 1e-5
    half = write_export(src, "merged", tmp_path / "h.safetensors", dtype="fp32", strength=0.5)
    model, _ = load_transformer(half, dtype=torch.float32)
    src.adapters.set_multiplier(0.5)
    assert rel_error(_out(model.eval(), x), _out(src.model, x)) < 1e-5


def test_diffusers_folder_reloads_to_the_merged_weights(tmp_path):
    src = load_source(P, _adapter_checkpoint(tmp_path))
    folder = write_export(src, "diffusers", tmp_path / "d", dtype="fp32")
    assert (folder / "config.json").is_file() and (folder / "diffusion_pytorch_model.safetensors.index.json").is_file()
    model, info = load_transformer(folder, dtype=torch.float32)
    state = merged_state(src, 1.0)
    assert info.layout == "official"
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_full_finetune_and_ema_exports(tmp_path):
    model = tiny_transformer()
    weights = {k: v + 0.01 for k, v in model.state_dict().items()}
    ema = {k: v + 0.02 for k, v in model.state_dict().items()}
    ck = save_checkpoint(tmp_path / "ck", 3, weights, {}, {"trained": {"algo": "full"}, "steps": 3}, ema=ema)
    src = load_source(P, ck)
    with pytest.raises(ExportError, match="merged"):
        write_export(src, "comfy", tmp_path / "c.safetensors")
    out, _ = load_transformer(write_export(src, "merged", tmp_path / "m.safetensors", dtype="fp32"),
                              dtype=torch.float32)
    assert all(torch.equal(out.state_dict()[k], v) for k, v in weights.items())
    out, _ = load_transformer(write_export(load_source(P, ck, ema=True), "diffusers", tmp_path / "e",
                                           dtype="fp32"), dtype=torch.float32)
    assert all(torch.equal(out.state_dict()[k], v) for k, v in ema.items())


def test_existing_output_replaced_only_when_the_new_one_is_complete(tmp_path, monkeypatch):
    src = load_source(P, _adapter_checkpoint(tmp_path))
    target = write_export(src, "lycoris", tmp_path / "x.safetensors")
    before = target.read_bytes()
    folder = write_export(src, "diffusers", tmp_path / "d")
    shard = next(folder.glob("*.safetensors")).read_bytes()
    import kohakumoss.formats.model_files as ck

    def boom(*a, **k):
        raise KeyboardInterrupt("killed mid-export")

    monkeypatch.setattr(ck, "write_safetensors", boom)
    with pytest.raises(KeyboardInterrupt):
        write_export(src, "diffusers", tmp_path / "d", strength=0.3)
    assert next(folder.glob("*.safetensors")).read_bytes() == shard
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".d")]
    assert target.read_bytes() == before


def test_vector_lycoris_file_converts_to_the_fused_comfy_layout(tmp_path):
    """`kmoss export checkpoint` on the vectors' LyCORIS file gives the weight deltas of the
    reference's fused ComfyUI file; `kmoss check export` passes on ours and fails on a broken one."""
    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    from kohakumoss.formats.comfy_semantics import comfy_weight_deltas
    from kohakumoss.formats.keys import fuse_qkv
    from stages.cli import app

    vec = ROOT / "tests" / "data" / "vectors"
    raw = repo_params_raw()
    raw["model"]["transformer"] = str(vec / "weights_official.safetensors")
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(raw))
    out = tmp_path / "fused.safetensors"
    runner = CliRunner()
    res = runner.invoke(app, ["export", "checkpoint", str(vec / "lora_lycoris.safetensors"), "--format",
                              "comfy", "--dtype", "fp32", "--out", str(out), "--params", str(params)])
    assert res.exit_code == 0, res.output
    base, _ = load_transformer(vec / "weights_official.safetensors", dtype=torch.float32)
    fused_base = fuse_qkv({k: v.detach() for k, v in base.state_dict().items()})
    ours, unloaded = comfy_weight_deltas(load_file(str(out)), fused_base)
    ref, _ = comfy_weight_deltas(load_file(str(vec / "lora_comfy_fused_qkv.safetensors")), fused_base)
    assert not unloaded and ours.keys() == ref.keys() and any("proj.qkv" in k for k in ours)
    assert all(rel_error(ours[k], ref[k]) < 1e-6 for k in ref)
    ok = runner.invoke(app, ["check", "export", str(out), "--source", str(vec / "lora_lycoris.safetensors"),
                             "--params", str(params), "--tolerance", "1e-5"])
    assert ok.exit_code == 0, ok.output
    broken = load_file(str(out))
    key = next(k for k in broken if k.endswith("lora_up.weight"))
    broken[key] = broken[key] * 1.1
    broken["lora_unet_not_a_layer.lora_up.weight"] = torch.zeros(2, 2)
    save_file(broken, str(tmp_path / "broken.safetensors"))
    bad = runner.invoke(app, ["check", "export", str(tmp_path / "broken.safetensors"), "--source",
                              str(vec / "lora_lycoris.safetensors"), "--params", str(params)])
    assert bad.exit_code == 1 and "FAIL" in bad.output and "not loaded by ComfyUI" in bad.output


def _run_params(tmp_path, name):

    raw = repo_params_raw()
    raw["run"]["name"] = name
    return parse_params(raw, str(tmp_path / "params.yaml"))


def test_export_stage_names_carry_run_experiment_and_step_and_replace_the_last_export(
        tmp_path, monkeypatch):
    """`runs/<name>/export/` holds only the current export, named
    <run>[-<experiment>]-<algo>-s<step>-<format>; the previous export's files are removed."""
    import dataclasses

    from kohakumoss.artifacts import read_manifest
    from kohakumoss.export.stage import EXPERIMENT_ENV, export_run

    runs = tmp_path / "runs"
    for step in (5, 7):
        _adapter_checkpoint(tmp_path, directory=runs / "mine" / "checkpoints", step=step)
    p = _run_params(tmp_path, "mine")
    monkeypatch.delenv(EXPERIMENT_ENV, raising=False)
    older = dataclasses.replace(p, export=dataclasses.replace(p.export, checkpoint="5"))
    first = export_run(older, runs)
    assert [w.name for w in first] == ["mine-lora-s5-comfy.safetensors", "mine-lora-s5-lycoris.safetensors"]
    out = runs / "mine" / "export"
    (out / "notes.txt").write_text("mine, not the export's")
    monkeypatch.setenv(EXPERIMENT_ENV, "lucid-gibb")
    second = export_run(p, runs)
    names = ["mine-lucid-gibb-lora-s7-comfy.safetensors", "mine-lucid-gibb-lora-s7-lycoris.safetensors"]
    assert [w.name for w in second] == names
    assert sorted(f.name for f in out.iterdir()) == sorted([*names, "manifest.json", "notes.txt"])
    manifest = read_manifest(out, "export")
    assert sorted(manifest.files) == names and manifest.info["experiment"] == "lucid-gibb"
    from safetensors import safe_open

    with safe_open(str(second[0]), "pt") as f:
        meta = f.metadata()
    assert meta["kohakumoss_run"] == "mine" and meta["kohakumoss_experiment"] == "lucid-gibb"
    _adapter_checkpoint(tmp_path, directory=runs / "theirs" / "checkpoints", step=7)
    monkeypatch.delenv(EXPERIMENT_ENV)
    theirs = export_run(_run_params(tmp_path, "theirs"), runs)
    assert [w.name for w in theirs] == ["theirs-lora-s7-comfy.safetensors",
                                        "theirs-lora-s7-lycoris.safetensors"]


def test_export_checkpoint_writes_outside_the_stage_outputs(tmp_path, monkeypatch):
    """`kmoss export checkpoint` of runs/<name>/checkpoints/step-N writes runs/<name>/exports/,
    never into the DVC-tracked checkpoints/ or export/ folders; a file elsewhere: beside it."""
    from typer.testing import CliRunner

    from stages.cli import app

    runs = tmp_path / "runs"
    ckpts = runs / "mine" / "checkpoints"
    step = _adapter_checkpoint(tmp_path, directory=ckpts, step=5)
    before = sorted(p.relative_to(ckpts) for p in ckpts.rglob("*"))
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    params = str(tmp_path / "params.yaml")
    Path(params).write_text(yaml.safe_dump(repo_params_raw()))
    res = runner.invoke(app, ["export", "checkpoint", str(step.relative_to(tmp_path)), "--params", params])
    assert res.exit_code == 0, res.output
    made = runs / "mine" / "exports" / "mine-lora-s5-comfy.safetensors"
    assert made.is_file() and "runs/mine/exports/mine-lora-s5-comfy.safetensors" in res.output
    assert sorted(p.relative_to(ckpts) for p in ckpts.rglob("*")) == before
    # a file inside the run (the stage's export/) -> exports/ too; a file elsewhere -> beside it
    (runs / "mine" / "export").mkdir()
    inside = runs / "mine" / "export" / "mine-lora-s5-lycoris.safetensors"
    src = load_source(P, step)
    write_export(src, "lycoris", inside)
    res = runner.invoke(app, ["export", "checkpoint", str(inside), "--params", params])
    assert res.exit_code == 0, res.output
    assert (runs / "mine" / "exports" / "mine-lora-s5-lycoris-comfy.safetensors").is_file()
    assert sorted(f.name for f in inside.parent.iterdir()) == [inside.name]
    loose = tmp_path / "elsewhere" / "adapter.safetensors"
    write_export(src, "lycoris", loose)
    res = runner.invoke(app, ["export", "checkpoint", str(loose), "--format", "merged", "--params", params])
    assert res.exit_code == 0, res.output
    assert (loose.parent / "adapter-merged.safetensors").is_file()


# -- load_trained: the one reader of a training checkpoint ----------------------------------------
def _trained_run(tmp_path, algo, **kw):
    """A checkpoint of a moved-off-init adapter, its EMA, and the two adapters they hold."""
    cfg = AdapterConfig(algo=algo, dim=4, alpha=4, **kw)
    g = torch.Generator().manual_seed(2)
    live = apply_adapters(tiny_transformer(), cfg, seed=P.run.seed)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() and v.ndim > 0
             else v for k, v in live.state_dict().items()}
    trainable = dict(live.named_trainable())
    ema = {k: v + 0.03 * torch.randn(v.shape, generator=g) for k, v in state.items() if k in trainable}
    trained = {"algo": algo, "preset": cfg.preset, "targets": [], "dim": 4, "alpha": 4.0,
               "dora": cfg.dora, "algo_kwargs": dict(cfg.algo_kwargs), "train_norms": cfg.train_norms}
    ck = save_checkpoint(tmp_path / algo, 9, state, {}, {"trained": trained}, ema=ema)
    return ck, cfg, state, {**state, **ema}


def _adapter_output(cfg, state, x, multiplier=1.0):
    model = tiny_transformer().eval()
    aset = apply_adapters(model, cfg, seed=123)
    aset.load_state_dict(state)
    aset.eval()
    aset.set_multiplier(multiplier)
    return _out(model, x)


@pytest.mark.parametrize("algo, kw", [("lora", {}), ("tlora", {}), ("loha", {"train_norms": True})])
def test_load_trained_gives_the_trained_adapter(tmp_path, algo, kw):
    from kohakumoss.formats.trained import load_trained

    ck, cfg, state, ema_state = _trained_run(tmp_path, algo, **kw)
    x = _inputs()
    for ema, want_state in ((False, state), (True, ema_state)):
        model = tiny_transformer().eval()
        t = load_trained(model, ck, ema=ema)
        assert not t.full and t.step == 9 and t.trained["algo"] == algo and t.config == cfg
        assert torch.equal(_out(model, x), _adapter_output(cfg, want_state, x)), ema
        t.adapters.remove()
        assert torch.equal(_out(model, x), _out(tiny_transformer().eval(), x))
    model = tiny_transformer().eval()
    load_trained(model, ck, multiplier=0.5)
    assert torch.equal(_out(model, x), _adapter_output(cfg, state, x, 0.5))


def test_load_trained_full_finetune_and_its_ema(tmp_path):
    from kohakumoss.formats.trained import TrainedError, load_trained

    base = tiny_transformer()
    weights = {k: v + 0.01 * (i % 3) for i, (k, v) in enumerate(base.state_dict().items())}
    ema = {k: v - 0.02 for k, v in weights.items()}
    ck = save_checkpoint(tmp_path / "ck", 3, weights, {}, {"trained": {"algo": "full"}}, ema=ema)
    x = _inputs()
    for use_ema, want in ((False, weights), (True, ema)):
        model = tiny_transformer().eval()
        t = load_trained(model, ck, ema=use_ema)
        assert t.full and t.adapters is None
        ref = tiny_transformer().eval()
        ref.load_state_dict(want)
        assert torch.equal(_out(model, x), _out(ref, x))
    no_ema = save_checkpoint(tmp_path / "plain", 3, weights, {}, {"trained": {"algo": "full"}})
    with pytest.raises(TrainedError, match="holds no EMA weights"):
        load_trained(tiny_transformer(), no_ema, ema=True)
    unknown = save_checkpoint(tmp_path / "odd", 3, weights, {}, {"trained": {"algo": "full", "x": 1}})
    with pytest.raises(TrainedError, match="state.json trained.x: unknown key"):
        load_trained(tiny_transformer(), unknown)
    bare = save_checkpoint(tmp_path / "bare", 3, weights, {}, {"steps": 3})
    with pytest.raises(TrainedError, match="records no 'trained'"):
        load_trained(tiny_transformer(), bare)


# -- kmoss export checkpoint --model: any base, no params file ------------------------------------
def test_export_checkpoint_with_model_needs_no_params_file(tmp_path, monkeypatch):
    """From a folder with no params.yaml: a LyCORIS file converts onto ``--model tiny`` (the
    ComfyUI file gives the trained deltas), a checkpoint exports byte-identically to the
    params-file way; without --model the error names the way out."""
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from kohakumoss.formats.comfy_semantics import comfy_weight_deltas
    from kohakumoss.formats.keys import fuse_qkv
    from stages.cli import app

    ck = _adapter_checkpoint(tmp_path, "loha")
    src = load_source(P, ck)
    lyco = write_export(src, "lycoris", tmp_path / "file" / "a.safetensors", dtype="fp32")
    work = tmp_path / "elsewhere"
    work.mkdir()
    monkeypatch.chdir(work)
    assert not (work / "params.yaml").exists()
    runner = CliRunner()
    res = runner.invoke(app, ["export", "checkpoint", str(lyco), "--model", "tiny", "--dtype", "fp32",
                              "--out", "c.safetensors"])
    assert res.exit_code == 0, res.output
    base = fuse_qkv({k: v.detach() for k, v in tiny_transformer().state_dict().items()})
    got, unloaded = comfy_weight_deltas(load_file(str(work / "c.safetensors")), base)
    from kohakumoss.export.check import trained_deltas

    want = trained_deltas(src.adapters, fused_qkv=True)
    assert not unloaded and sorted(got) == sorted(want)
    assert all(rel_error(got[k], want[k]) < 1e-6 for k in want)
    res = runner.invoke(app, ["export", "checkpoint", str(ck), "--model", "tiny", "--format", "merged",
                              "--out", "m.safetensors"])
    assert res.exit_code == 0, res.output
    with_params = write_export(src, "merged", tmp_path / "m.safetensors")
    assert (work / "m.safetensors").read_bytes() == with_params.read_bytes()
    res = runner.invoke(app, ["export", "checkpoint", str(lyco), "--out", "x.safetensors"])
    assert res.exit_code == 2 and "--model" in res.output and "params" in res.output, res.output
    assert not (work / "x.safetensors").exists()


@pytest.mark.parametrize("rotations, blocks", [("blocks", True), ("diff", False)])
def test_export_stage_writes_oft_as_export_rotations_says(tmp_path, monkeypatch, rotations, blocks):
    """`export.rotations` reaches the comfy file the stage writes: OFT's native blocks (a
    biased layer is a dense diff either way), or dense diffs only (which ComfyUI's strength
    slider scales linearly)."""
    import dataclasses

    from safetensors import safe_open

    from kohakumoss.export.stage import EXPERIMENT_ENV, export_run

    monkeypatch.delenv(EXPERIMENT_ENV, raising=False)
    runs = tmp_path / "runs"
    _adapter_checkpoint(tmp_path, algo="oft", directory=runs / "mine" / "checkpoints", step=7)
    p = _run_params(tmp_path, "mine")
    p = dataclasses.replace(p, export=dataclasses.replace(p.export, formats=("comfy",),
                                                          rotations=rotations))
    (comfy,) = export_run(p, runs)
    with safe_open(str(comfy), "pt") as f:
        suffixes = {k.split(".", 1)[1].removesuffix(".weight") for k in f.keys()}
    assert ("oft_blocks" in suffixes) == blocks and "diff" in suffixes


@pytest.mark.parametrize("algo, kw, reads_weights", [
    ("lora", {}, False), ("loha", {}, False), ("lokr", {}, False), ("lora", {"dora": True}, True),
    ("oft", {}, True)])  # OFT's fused q/k/v: a dense (R - I) W
def test_an_adapters_export_needs_only_the_bases_shapes(tmp_path, monkeypatch, algo, kw, reads_weights):
    """The comfy and lycoris files of an adapter are written on a base of shapes only (the
    meta device: no fp32 base in host memory), bit for bit the files written on the base's
    weights; where building the adapter or a conversion reads the weights (DoRA's scale,
    OFT's fused q/k/v as a dense diff) the stage loads them and writes from them."""
    from safetensors.torch import load_file

    from kohakumoss.export import stage

    monkeypatch.delenv(stage.EXPERIMENT_ENV, raising=False)
    runs = tmp_path / "runs"
    ck = _adapter_checkpoint(tmp_path, algo=algo, directory=runs / "mine" / "checkpoints", **kw)
    p = _run_params(tmp_path, "mine")
    loads, real = [], stage.load_source

    def load_source_spy(*args, **kwargs):
        loads.append(kwargs.get("shapes_only", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(stage, "load_source", load_source_spy)
    files = stage.export_run(p, runs)
    assert loads == ([True, False] if reads_weights else [True])
    src = load_source(p, ck)  # the base's weights
    assert not src.shapes_only
    for f in files:
        fmt = f.name.rsplit("-", 1)[1].removesuffix(".safetensors")
        want = write_export(src, fmt, tmp_path / "ref" / f.name, fused_qkv=p.export.fused_qkv,
                            style=p.export.style, dtype=p.export.dtype, rotations=p.export.rotations)
        got, ref = load_file(str(f)), load_file(str(want))
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref), f.name


def test_a_full_finetune_does_not_load_into_shapes(tmp_path):
    """A base of shapes only takes an adapter, never a full finetune's weights."""
    from kohakumoss.formats.trained import TrainedError

    ck = save_checkpoint(tmp_path / "ck", 3, tiny_transformer().state_dict(), {},
                         {"trained": {"algo": "full", "preset": "attn-mlp", "targets": [], "dim": 4,
                                      "alpha": 4.0, "dora": False, "algo_kwargs": {},
                                      "train_norms": False}, "steps": 3})
    with pytest.raises(TrainedError, match="full finetune: it loads into a base's weights"):
        load_source(P, ck, shapes_only=True)
