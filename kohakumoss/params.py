"""params.yaml -> a checked ``Params``: every section parsed strictly, then every check that
can run before a stage does any work (``kohakumoss.checks.params``): ``parse_params`` runs the
pure ones (cross-section rules, refused knobs, the adapter's combination), ``load_params``
also those that read file headers (weight paths, adapter targets against the transformer).

``config.py`` declares the sections; this module sits above ``config`` and ``data`` because
dataset entries and caption templates are parsed by the data package's own types.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import yaml

from kohakumoss.checks.params import check_adapter, check_targets, check_weights
from kohakumoss.config import DATASET_KEYS, MASK_MODES, SECTIONS, TOP_LEVEL, DatasetEntry, Params, parallel_mode
from kohakumoss.configlib import ConfigError, build, coerce, fail
from kohakumoss.data.captions import parse_template
from kohakumoss.data.sources import SOURCES
from kohakumoss.quant import quant_plan
from kohakumoss.optimizers import optimizer_kind, refusal

def parse_dataset(mapping: Any, where: str) -> DatasetEntry:
    if not isinstance(mapping, dict) or "source" not in mapping:
        raise ConfigError(f"{where} must be a mapping with a 'source' key "
                          f"(one of {', '.join(sorted(SOURCES))}), got {mapping!r}")
    name = mapping["source"]
    if name not in SOURCES:
        fail(f"{where}.source", name, "one of " + ", ".join(sorted(SOURCES)))
    own = {k: v for k, v in mapping.items() if k != "source" and k not in DATASET_KEYS}
    args = build(SOURCES[name], own, where)
    weight = coerce(float, mapping.get("weight", 1.0), f"{where}.weight")
    if weight < 0:
        fail(f"{where}.weight", weight, "a number >= 0")
    loss_weight = coerce(float, mapping.get("loss_weight", 1.0), f"{where}.loss_weight")
    caption = mapping.get("caption")
    if caption is not None:
        caption = parse_template(caption, f"{where}.caption")
    validation = coerce(bool, mapping.get("validation", False), f"{where}.validation")
    mask = mapping.get("mask", "off")
    if mask is False:  # YAML's off
        mask = "off"
    if mask not in MASK_MODES:
        fail(f"{where}.mask", mask, "one of " + ", ".join(MASK_MODES) + " (file: kohya's "
             "img.mask.png beside each image; alpha: the image's alpha channel; auto: the file, "
             "else the alpha channel)")
    return DatasetEntry(source=name, args=args, weight=weight, loss_weight=loss_weight,
                        caption=caption, validation=validation, mask=mask)


def parse_params(raw: Any, path: str = "params.yaml") -> Params:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of sections, got {type(raw).__name__}")
    unknown = [k for k in raw if k not in SECTIONS and k not in TOP_LEVEL]
    if unknown:
        import difflib

        near = difflib.get_close_matches(str(unknown[0]), [*SECTIONS, *TOP_LEVEL], n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ConfigError(f"{path}: unknown section {unknown[0]!r}{hint} "
                          f"(sections: {', '.join(SECTIONS)}; keys: {', '.join(TOP_LEVEL)})")
    top = {}
    for key, allowed in TOP_LEVEL.items():
        value = raw.get(key, Params.__dataclass_fields__[key].default)
        if value not in allowed:
            fail(f"{path}: {key}", value, "one of " + ", ".join(allowed))
        top[key] = value
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        body = dict(raw.get(name) or {})
        where = f"{path}: {name}"
        if name == "data":
            datasets = body.pop("datasets", None)
            if not isinstance(datasets, list) or not datasets:
                raise ConfigError(f"{where}.datasets must be a non-empty list of dataset entries "
                                  f"(e.g. - {{source: kohya, path: my_dataset}}), got {datasets!r}")
            parsed = tuple(parse_dataset(d, f"{where}.datasets[{i}]") for i, d in enumerate(datasets))
            sections[name] = dataclasses.replace(build(cls, body, where), datasets=parsed)
        elif name == "objective" and "sampler" in body:
            raise ConfigError(f"{where}.sampler was renamed objective.timesteps (the training "
                              f"timestep distribution: moss | uniform | logit_normal); 'sampler' "
                              f"now names only the inference sampler")
        elif name == "caption":
            template = body.pop("template", None)
            spec = parse_template(template if template is not None else {"template": "tags"},
                                  f"{where}.template")
            sections[name] = dataclasses.replace(build(cls, body, where), template=spec)
        else:
            sections[name] = build(cls, body, where)
    params = Params(**sections, **top, path=path)
    changed = [f"memory.{f.name} = {getattr(params.memory, f.name)!r}"
               for f in dataclasses.fields(params.memory)
               if getattr(params.memory, f.name) != f.default]
    if changed and params.profile != "manual":
        raise ConfigError(f"{path}: {', '.join(changed)} with profile: {params.profile}; the "
                          f"profile sets the memory engines itself (docs/memory.md). Set "
                          f"profile: manual to choose them in the memory section, or leave the "
                          f"section at its defaults")
    check_memory(params)
    validate(params)
    check_adapter(params)
    return params


def validate(p: Params) -> None:
    """Cross-section rules (``docs/data.md#cross-section-rules``)."""
    where = f"{p.path}: batching.token_budget"
    if p.batching.token_budget == "exact" and not p.caption.tokenizer:
        fail(where, "exact", "'exact' needs caption.tokenizer set to a tokenizer folder; "
             "use 'auto' or 'estimate' without one")
    if p.parallel.mode == "fsdp" and not p.adapter.full:
        fail(f"{p.path}: parallel.mode", "fsdp",
             "ddp or auto with an adapter (FSDP2 shards a full finetune's weights, gradients "
             "and optimizer states; an adapter's base is frozen and its trained tensors are "
             "small: every rank holds them whole)")
    if parallel_mode(p) == "threaded":
        check_threaded(p)
    refuse_unhonoured(p)


def check_threaded(p: Params) -> None:
    """``parallel.mode: threaded`` (one process, the joint blocks split over devices)."""
    par, where = p.parallel, f"{p.path}: parallel"
    if par.world_size != 1:
        fail(f"{where}.world_size", par.world_size,
             "1 with parallel.mode: threaded (one process drives every device of the split; "
             "the split over several processes is not built: use parallel.mode: ddp)")
    if len(par.devices) == 1:
        fail(f"{where}.devices", list(par.devices),
             "two or more devices with parallel.mode: threaded (e.g. [cuda:0, cuda:1]), or "
             "none: every visible CUDA card")
    same = {"cuda": "cuda:0"}
    if par.devices and p.train.device != "auto" and \
            same.get(p.train.device, p.train.device) != same.get(par.devices[0], par.devices[0]):
        fail(f"{where}.devices", list(par.devices),
             f"a list whose first device is train.device ({p.train.device}): the first device "
             f"holds the batch, the head and the loss")


def refuse_unhonoured(p: Params) -> None:
    """Knobs that parse but that no engine honours yet: accepting them would train something
    other than what params.yaml says, so they are refused until their issue lands
    (``docs/architecture.md#refused-knobs``)."""
    check_optimizer(p)
    check_precision(p)
    if p.train.dtype == "fp16" and p.precision.loss_scale == "off":
        raise ConfigError(
            f"{p.path}: train.dtype = 'fp16' with precision.loss_scale: off: fp16 gradients "
            f"underflow silently without loss scaling; set precision.loss_scale: auto, or use bf16 (any GPU from "
            f"Ampere on, and the CPU) or fp32")


def check_optimizer(p: Params) -> None:
    """``optim.name`` against the rest of the run (``training.optimizers.OPTIMIZERS``: what
    each one refuses, and why)."""
    name, o = p.optim.name, p.optim
    uses = {"fsdp": (parallel_mode(p) == "fsdp", "parallel.world_size",
                     f"{p.parallel.world_size} and adapter.algo: full (FSDP2)",
                     "optim.name: adamw, or parallel.mode: ddp (every rank the whole model)"),
            "ema": (o.ema > 0, "optim.ema", o.ema, "optim.ema: 0"),
            "schedule": (o.schedule != "constant", "optim.schedule", o.schedule, "constant"),
            "zero_lr": (o.lr == 0, "optim.lr", o.lr, "optim.lr > 0"),
            p.memory.optimizer: (p.profile == "manual" and p.memory.optimizer != "device",
                                 "memory.optimizer", p.memory.optimizer,
                                 "memory.optimizer: device")}
    library = optimizer_kind(name).library
    if importlib.util.find_spec(library) is None:
        raise ConfigError(f"{p.path}: optim.name = {name} needs the {library} package, which is "
                          f"not installed: pip install -e '.[eightbit]' (or pip install {library})")
    for what, (used, knob, value, fix) in uses.items():
        why = refusal(name, what) if used else None
        if why:
            raise ConfigError(f"{p.path}: {knob} = {value} with optim.name: {name}: {why}; use "
                              f"{fix}, or another optim.name")


def check_precision(p: Params) -> None:
    """A quantized base (``precision.base``) and fp8 compute against the rest of the run
    (the device's part is checked when train knows the device: ``engine_plan``)."""
    q, where = quant_plan(p.precision), f"{p.path}: precision"
    if q.base != "keep" and p.adapter.full:
        fail(f"{where}.base", q.base, "keep with adapter.algo: full (a full finetune trains the "
             "base's weights; only a frozen base is held quantized)")
    if q.base != "keep" and (p.profile in ("low", "minimal") or p.memory.stream_slots):
        fail(f"{where}.base", q.base, f"keep with profile {p.profile} (weight streaming moves "
             f"bf16 block weights; a quantized base does not stream yet: use profile speed, "
             f"balanced or manual without memory.stream_slots)")
    if q.compute and q.base != "fp8":
        fail(f"{where}.fp8_compute", q.knob, f"off with precision.base: {q.base} (fp8 "
             f"GEMMs multiply fp8 weights: set precision.base: fp8)")
    if q.compute and p.train.dtype != "bf16":
        fail(f"{where}.fp8_compute", q.knob, f"off with train.dtype: {p.train.dtype} (the "
             f"fp8 GEMMs write bf16: set train.dtype: bf16)")


def check_memory(p: Params) -> None:
    """The ``memory:`` knobs against each other (the profile's own settings are valid)."""
    m, where = p.memory, f"{p.path}: memory"
    if m.checkpointing == "partial" and m.checkpoint_blocks < 1:
        fail(f"{where}.checkpoint_blocks", m.checkpoint_blocks,
             "an integer >= 1 with checkpointing: partial (how many blocks of each list, from "
             "the first, keep only their input)")
    if m.stream_slots and p.adapter.full and m.optimizer != "host":
        fail(f"{where}.stream_slots", m.stream_slots,
             "0 for a full finetune with memory.optimizer: device (a streamed full finetune "
             "keeps its fp32 masters and optimizer states on the host: set memory.optimizer: "
             "host)")
    if m.optimizer == "fused":
        _check_fused(p)
    if m.optimizer == "streamed" and parallel_mode(p) == "fsdp":
        fail(f"{where}.optimizer", "streamed",
             f"device or host with a full finetune over parallel.world_size = "
             f"{p.parallel.world_size} (FSDP2 shards the optimizer states, 1/{p.parallel.world_size} "
             f"a rank, and host offloads each rank's shard; the streamed states would not stream)")
    if m.offload and m.checkpointing not in ("block", "sub-block"):
        fail(f"{where}.offload", m.offload,
             f"false with checkpointing: {m.checkpointing} (activation offload moves what "
             f"block or sub-block checkpointing keeps, the blocks' or halves' inputs, to the "
             f"host: set checkpointing: block or sub-block)")
    if m.rebuild and m.checkpointing not in ("none", "partial"):
        fail(f"{where}.rebuild", m.rebuild,
             f"false with checkpointing: {m.checkpointing} (rebuilding drops the elementwise "
             f"outputs a block keeps; a checkpointed block keeps none of them: use it with "
             f"checkpointing: none or partial)")
    if m.fp8_transposes and (not quant_plan(p.precision).keeps_transposes or p.adapter.full):
        fail(f"{where}.fp8_transposes", m.fp8_transposes,
             f"false with precision.fp8_compute: {quant_plan(p.precision).knob}"
             f"{' and a full finetune' if p.adapter.full else ''} (it keeps the fp8 input "
             f"gradients' transposed weight codes between steps: set precision.fp8_compute: full "
             f"(or fast) on a frozen fp8 base)")
    if m.checkpointing != "partial" and m.checkpoint_blocks:
        fail(f"{where}.checkpoint_blocks", m.checkpoint_blocks,
             f"0 with checkpointing: {m.checkpointing} (it counts blocks for checkpointing: "
             f"partial only)")


def _check_fused(p: Params) -> None:
    """The step in backward updates each tensor before the others' gradients exist."""
    where = f"{p.path}: memory.optimizer"
    if p.optim.grad_clip > 0:
        fail(where, "fused", f"device or streamed with optim.grad_clip = {p.optim.grad_clip} "
             f"(clipping by the global norm needs every gradient before the first update, and "
             f"the step in backward has updated most tensors by then: set optim.grad_clip: 0 "
             f"to keep fused)")
    if p.train.dtype == "fp16":
        fail(where, "fused", "device or streamed with train.dtype: fp16 (loss scaling unscales "
             "every gradient and skips a step that overflowed, after backward: use bf16 or "
             "fp32 to keep fused)")
    if p.parallel.world_size > 1:
        fail(where, "fused", f"device or streamed with parallel.world_size = "
             f"{p.parallel.world_size} (the ranks' gradients are summed after backward; the "
             f"step in backward would update before that)")


def load_params(path: str | Path = "params.yaml") -> Params:
    """The params file, parsed and checked (weights and adapter targets included)."""
    params = read_params(path)
    check_targets(params, check_weights(params))
    return params


def read_params(path: str | Path = "params.yaml") -> Params:
    """The params file parsed, with the checks that need no other file (``kmoss doctor``
    reports the weight paths itself, one line each)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"params file {path} does not exist; run from the project root or pass "
                          f"--params PATH")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    return parse_params(raw, str(path))
