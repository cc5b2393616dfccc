"""Parity of our model against a reference vector set (the format of the public vectors).

A vector set is a folder with ``weights_official.safetensors`` and/or
``weights_comfy.safetensors`` (any tiny config: it is inferred from the shapes),
``batch.safetensors`` (inputs, layout, reference outputs ``v_fp32`` / ``v_fp64`` and
optional intermediates ``inter.*``) and ``config.json``. Every comparison is a relative
error ``||ours - ref|| / ||ref||`` in float64 against a tolerance: 1e-5 for float32 runs,
1e-6 for float64 runs, exact equality for the layout.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file

from kohakumoss.formats.model_files import load_transformer
from kohakumoss.diffusion.schedule import inference_sigmas
from kohakumoss.diffusion.timesteps import TECH_REPORT, MossTimesteps
from kohakumoss.model.engines import Handle
from kohakumoss.model.layout import build_layout

# the knobs of a MossTimesteps a set may declare (schedules.sampler_knobs, stages[].knobs)
TIMESTEP_KNOBS = {"steps", "mu", "s", "cutoff", "uniform_mix", "p_full", "shift", "schedule"}
TOL = {torch.float32: 1e-5, torch.float64: 1e-6}
WEIGHT_FILES = {"official": "weights_official.safetensors", "comfy": "weights_comfy.safetensors"}


@dataclasses.dataclass
class Comparison:
    name: str
    error: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.error <= self.tolerance

    def line(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return f"{verdict}  {self.name:<44} rel {self.error:.3e}  (tol {self.tolerance:.0e})"


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    a, b = ours.detach().double().cpu(), ref.detach().double().cpu()
    if a.shape != b.shape:
        return float("inf")
    denom = b.norm()
    return float((a - b).norm() / denom) if denom > 0 else float((a - b).norm())


def load_batch(folder: Path) -> dict[str, torch.Tensor]:
    # copies: CPU float32 results move with input memory alignment (see the vectors README)
    return {k: v.clone() for k, v in load_file(str(folder / "batch.safetensors")).items()}


def model_comparisons(folder: Path) -> Iterator[Comparison]:
    batch = load_batch(folder)
    layout = build_layout(batch["hw"].tolist(), batch["text_len"].tolist())
    for key in [k for k in batch if k.startswith("layout.")]:
        ours = getattr(layout, key.removeprefix("layout."))
        same = torch.equal(ours.to(batch[key].dtype), batch[key])
        yield Comparison(f"layout {key.removeprefix('layout.')}", 0.0 if same else 1.0, 0.0)
    found = [(fmt, folder / f) for fmt, f in WEIGHT_FILES.items() if (folder / f).is_file()]
    if not found:
        raise FileNotFoundError(f"{folder} holds neither {' nor '.join(WEIGHT_FILES.values())}")
    inputs = (batch["img"], batch["text"], batch["sigma"], layout)
    for fmt, path in found:
        for dtype, ref_key in ((torch.float32, "v_fp32"), (torch.float64, "v_fp64")):
            if ref_key not in batch:
                continue
            model, _ = load_transformer(path, dtype=dtype)
            trace: dict[str, torch.Tensor] = {}
            hooks = [model.layers[0].register_forward_pre_hook(
                lambda m, args: trace.__setitem__("joint_embed", args[0]))]
            for i, block in enumerate(model.layers):
                hooks.append(block.register_forward_hook(
                    lambda m, args, out, i=i: trace.__setitem__(f"block_{i}_out", out)))
            # the captured blocks' calls must happen: the registry runs them whole
            with torch.no_grad(), model.engines.holding(Handle("parity captures",
                                                               blocks=tuple(model.layers))):
                v = model(*inputs)
                mod, head = model.conditioning(batch["sigma"])
                trace.update(cond_block_mod=mod, cond_head_mod=head,
                             text_refiner_out=model.refine_text(batch["text"], layout))
            for h in hooks:
                h.remove()
            name = "fp32" if dtype == torch.float32 else "fp64"
            yield Comparison(f"{fmt} {name} velocity vs {ref_key}", rel_error(v, batch[ref_key]), TOL[dtype])
            if dtype == torch.float64:  # the stored intermediates come from the float64 run
                for key, ours in trace.items():
                    if f"inter.{key}" in batch:
                        yield Comparison(f"{fmt} fp64 {key}", rel_error(ours, batch[f"inter.{key}"]),
                                         TOL[dtype])


def declared(folder: Path) -> dict:
    """The set's ``config.json`` (``{}`` when it has none)."""
    path = folder / "config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _fail(name: str, why: str) -> Comparison:
    return Comparison(f"{name}: {why}", float("inf"), 0.0)


def declared_timesteps(config: dict) -> tuple[MossTimesteps | None, list[int], str | None]:
    """(the MOSS timestep distribution the set declares, each stage's start step, a reason
    it cannot be built). A set without ``config.json`` declares the defaults; knobs this
    package does not know are refused, never silently replaced by defaults."""
    sched = config.get("schedules", {})
    knobs = dict(sched.get("sampler_knobs") or {})
    unknown = sorted(set(knobs) - TIMESTEP_KNOBS)
    if unknown:
        return None, [], f"unknown knob(s) {unknown} in config.json schedules.sampler_knobs"
    named = knobs.pop("schedule", None)
    stages = sched.get("stages") or []
    for n, stage in enumerate(stages):
        bad = sorted(set(stage.get("knobs", {})) - (TIMESTEP_KNOBS - {"steps", "schedule"}))
        if bad:
            return None, [], f"stage {n} declares unknown knob(s) {bad}"
    if len(stages) > 1:  # a staged table: every stage as declared
        schedule = tuple((int(st["start_step"]), dict(st["knobs"])) for st in stages)
    elif named == "tech_report":
        schedule = TECH_REPORT
    elif named:
        return None, [], f"unknown schedule {named!r} in config.json schedules.sampler_knobs"
    else:
        schedule = ()
        if stages:  # one stage: its knobs are the distribution's
            knobs.update(stages[0].get("knobs", {}))
    starts = [start for start, _ in schedule] or [0]
    return MossTimesteps(**knobs, schedule=schedule), starts, None


def schedule_comparisons(folder: Path) -> Iterator[Comparison]:
    """The timestep distribution's tables and draws, stage by stage, with the knobs the set
    declares, and every inference sigma schedule it stores or lists."""
    path = folder / "schedules.safetensors"
    if not path.is_file():
        return
    ref = load_file(str(path))
    config = declared(folder)
    timesteps, starts, why = declared_timesteps(config)
    stage_keys = sorted({k.split(".")[1] for k in ref if k.startswith("sampler.")})
    for stage in stage_keys:
        name = f"timesteps {stage}"
        n = int(stage.removeprefix("stage")) if stage.removeprefix("stage").isdigit() else -1
        if timesteps is None:
            yield _fail(name, why)
            continue
        if not 0 <= n < len(starts):
            yield _fail(name, f"schedules.safetensors holds it but config.json declares "
                              f"{len(starts)} stage(s)")
            continue
        tables = dict(zip(("pmf", "sigma", "cdf"), timesteps.tables(starts[n])))
        for key in sorted(k for k in ref if k.startswith(f"sampler.{stage}.")):
            leaf = key.split(".")[-1]
            if leaf in tables:
                yield Comparison(f"{name} {leaf}", rel_error(tables[leaf], ref[key]), 1e-6)
            elif leaf.startswith("draws_seed"):
                seed = int(leaf.removeprefix("draws_seed"))
                draws = timesteps.sample(len(ref[key]), torch.Generator().manual_seed(seed),
                                         step=starts[n])
                yield Comparison(f"{name} draws (seed {seed})", rel_error(draws, ref[key]), 1e-6)
    yield from inference_comparisons(ref, config)


def inference_comparisons(ref: dict[str, torch.Tensor], config: dict) -> Iterator[Comparison]:
    """Each stored ``infer.steps{S}_shift{K}`` tensor and each schedule ``config.json`` lists
    (``"steps=S shift=K"`` with its sigmas), on the declared training grid."""
    sched = config.get("schedules", {})
    knobs = sched.get("inference_default_knobs", {})
    grid = int(knobs.get("total", 1000))
    if float(knobs.get("training_shift", 1.0)) != 1.0:
        yield _fail("inference sigmas", f"a training grid shifted by {knobs['training_shift']} "
                                        f"is declared; this package snaps to the unshifted grid")
        return
    wanted: dict[tuple[int, float], list[tuple[str, torch.Tensor]]] = {}
    for key, value in ref.items():
        if key.startswith("infer.steps"):
            steps, shift = key.removeprefix("infer.steps").split("_shift")
            wanted.setdefault((int(steps), float(shift)), []).append(("stored", value))
    for label, entry in (sched.get("inference") or {}).items():
        fields = dict(part.split("=") for part in label.split())
        listed = torch.tensor(entry["sigmas"], dtype=torch.float32)
        wanted.setdefault((int(fields["steps"]), float(fields["shift"])), []).append(("listed", listed))
    for (steps, shift), refs in sorted(wanted.items()):
        ours = inference_sigmas(steps, shift, grid)
        for where, value in refs:
            yield Comparison(f"inference sigmas steps {steps} shift {shift:g} ({where})",
                             rel_error(ours, value), 1e-6)


def all_comparisons(folder: str | Path) -> Iterator[Comparison]:
    folder = Path(folder)
    yield from model_comparisons(folder)
    yield from schedule_comparisons(folder)
    yield from lora_comparisons(folder)


def run_parity(folder: str | Path) -> list[Comparison]:
    return list(all_comparisons(folder))


LORA_FILES = ("lora_lycoris", "lora_comfy", "lora_comfy_fused_qkv")


def lora_comparisons(folder: str | Path) -> Iterator[Comparison]:
    """Each LoRA file of the set (LyCORIS native, ComfyUI, ComfyUI fused q/k/v) loaded on the
    official weights in float32 and float64, bypass and merge, at multiplier 1 against
    ``v_lora_*`` and at ``config.json`` -> ``lora.m2`` against ``v_lora_m2_*``."""
    from kohakumoss.formats.comfy import load_adapter_file

    folder = Path(folder)
    files = [(stem, folder / f"{stem}.safetensors") for stem in LORA_FILES]
    files = [(stem, p) for stem, p in files if p.is_file()]
    weights = next((folder / f for f in WEIGHT_FILES.values() if (folder / f).is_file()), None)
    if not files or weights is None:
        return
    batch = load_batch(folder)
    config = folder / "config.json"
    m2 = json.loads(config.read_text()).get("lora", {}).get("m2") if config.is_file() else None
    layout = build_layout(batch["hw"].tolist(), batch["text_len"].tolist())
    inputs = (batch["img"], batch["text"], batch["sigma"], layout)
    for dtype, name in ((torch.float32, "fp32"), (torch.float64, "fp64")):
        model, _ = load_transformer(weights, dtype=dtype)
        runs = [(1.0, f"v_lora_{name}"), (m2, f"v_lora_m2_{name}")]
        for stem, path in files:
            for mode in ("bypass", "merge"):
                for m, ref in runs:
                    if m is None or ref not in batch:
                        continue
                    handle = load_adapter_file(model, path, multiplier=float(m), mode=mode)
                    with torch.no_grad():
                        v = model(*inputs)
                    handle.remove()
                    yield Comparison(f"lora {stem.removeprefix('lora_')} {name} {mode} m={m:g}",
                                     rel_error(v, batch[ref]), TOL[dtype])
