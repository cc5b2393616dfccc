"""``params.yaml`` sections as frozen dataclasses, loaded strictly.

Each top-level section maps to one dataclass below; ``load_params`` builds them all and
fails on the first unknown key, wrong type or bad value with a message that names the key,
the value and what is allowed. Stages read only the sections (and keys) they declare in
``dvc.yaml``; ``stage_params`` gives the exact dict a stage's manifest hashes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

from kohakumoss.configlib import knob, to_plain

# Defaults of the data.max_* knobs (docs/data.md, "Hostile and broken input"):
# - 16384 characters per caption field: 4096 text tokens at ~4 characters each, never cutting
#   what the encoder reads; it stops a runaway file (a 10 MB caption took plan to 5.6 GB).
# - 178,956,970 pixels (13377 x 13377): PIL's hard limit, 2 x Image.MAX_IMAGE_PIXELS.
MAX_CAPTION_CHARS = 16384
MAX_IMAGE_PIXELS = 178_956_970

Background = Literal["white", "black", "gray"]


def _positive(v: Any) -> bool:
    return v > 0


@dataclasses.dataclass(frozen=True)
class RunConfig:
    name: str = knob("default", check=lambda v: v.replace("-", "").replace("_", "").isalnum(),
                     allowed="letters, digits, '-' and '_' (it names runs/<name>/)")
    seed: int = knob(0, check=lambda v: v >= 0, allowed="an integer >= 0")


@dataclasses.dataclass(frozen=True)
class DatasetEntry:
    """One dataset: a source (``source`` name + its own arguments) and dataset-level keys."""

    source: str
    args: Any  # the source's own frozen dataclass
    weight: float = 1.0
    loss_weight: float = 1.0
    caption: Any = None  # a caption TemplateSpec overriding caption.template, or None
    validation: bool = False  # held out whole: evaluated (validation.every), never trained on
    mask: str = "off"  # the loss mask: off | auto | alpha | file (kohakumoss.data.masks)


DATASET_KEYS = ("weight", "loss_weight", "caption", "validation", "mask")
MASK_MODES = ("off", "auto", "alpha", "file")  # a dataset entry's loss mask (data/masks.py)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    datasets: tuple = ()
    rescan: bool | Literal["never"] = knob(False, help="false: re-probe new and changed items; "
                                           "true: re-probe everything; never: trust the catalog")
    scan_workers: int = knob(2, check=lambda v: v >= 0, allowed="an integer >= 0")
    num_workers: int = knob(2, check=lambda v: v >= 0, allowed="an integer >= 0")
    prefetch: int = knob(2, check=lambda v: v >= 1, allowed="an integer >= 1")
    # the scan's defences against hostile files (docs/data.md, "Hostile and broken input")
    max_caption_chars: int = knob(MAX_CAPTION_CHARS, check=lambda v: v >= 1,
                                  allowed="an integer >= 1 (characters per caption field)")
    caption_errors: Literal["skip", "replace", "strict"] = knob(
        "skip", help="a caption that is not UTF-8: skip (report, leave the image out) | "
                     "replace (decode as U+FFFD, warn) | strict (fail the scan)")
    max_image_pixels: int = knob(MAX_IMAGE_PIXELS, check=lambda v: v >= 1,
                                 allowed="an integer >= 1 (declared width x height)")
    verify_images: bool = knob(True, help="read each new image's data once at scan time, so "
                                          "truncated files are reported; false = headers only")


@dataclasses.dataclass(frozen=True)
class ResolutionConfig:
    mode: Literal["resize", "bucket", "crop", "keep", "square"] = "bucket"
    target_area: int = knob(1024 * 1024, check=lambda v: v >= 256, allowed="an integer >= 256 (pixels)")
    size_step: int = knob(16, check=lambda v: v >= 16 and v % 16 == 0,
                          allowed="a positive multiple of 16 (one latent token is 16x16 pixels)")
    aspect_range: tuple[float, float] = knob(
        (0.33, 3.0), check=lambda v: 0 < v[0] <= 1 <= v[1],
        allowed="[min_w_over_h, max_w_over_h] with 0 < min <= 1 <= max")
    upscale: Literal["never", "to_area"] = "never"
    crop: Literal["center", "random"] = "center"
    flip: bool = False
    background: Background | tuple[int, int, int] = knob(
        "white", check=lambda v: isinstance(v, str) or all(0 <= c <= 255 for c in v),
        allowed="white, black, gray or [r, g, b] with 0..255")
    resample: Literal["lanczos", "bicubic", "bilinear", "box"] = "lanczos"


@dataclasses.dataclass(frozen=True)
class CaptionConfig:
    template: Any = None  # TemplateSpec; None -> the default tags template
    variants: int = knob(4, check=lambda v: v >= 1, allowed="an integer >= 1")
    text_drop: float = knob(0.1, check=lambda v: 0.0 <= v <= 1.0, allowed="a probability in [0, 1]")
    chars_per_token: float = knob(3.5, check=_positive, allowed="a number > 0")
    overhead_tokens: int = knob(12, check=lambda v: v >= 0, allowed="an integer >= 0")
    max_text_tokens: int = knob(4096, check=lambda v: v >= 1, allowed="an integer >= 1")
    tokenizer: str = knob("", help="'tiny', or a tokenizer folder, for exact text token counts; "
                                   "'' = estimate")


@dataclasses.dataclass(frozen=True)
class BatchingConfig:
    mode: Literal["tokens", "tokens_ffd", "count"] = "tokens"
    max_tokens: int = knob(16384, check=lambda v: v >= 2, allowed="an integer >= 2")
    max_samples: int = knob(0, check=lambda v: v >= 0, allowed="an integer >= 0 (0 = no cap)")
    batch_size: int = knob(4, check=lambda v: v >= 1, allowed="an integer >= 1")
    window: int = knob(256, check=lambda v: v >= 1, allowed="an integer >= 1")
    drop_last: bool = True
    overlong: Literal["drop", "truncate_text", "drop_tokens"] = "drop"
    token_budget: Literal["auto", "estimate", "render", "exact"] = "auto"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Where the weights are: "tiny" builds the embedded tiny component in code."""

    transformer: str = knob("tiny", help="'tiny', a MOSS-Image pipeline folder, its transformer/ "
                                         "folder, or a ComfyUI diffusion_models/*.safetensors file")
    text_encoder: str = knob("tiny", help="'tiny', a pipeline folder, a text_encoder/ folder, or a "
                                          "ComfyUI text_encoders/*.safetensors file")
    tokenizer: str = knob("", help="tokenizer folder for a single-file text encoder ('' = beside it)")
    vae: str = knob("tiny", help="'tiny', a pipeline folder, a vae/ folder, or a ComfyUI "
                                 "vae/*.safetensors file")


def _dtype_knob(default: str, allowed: tuple[str, ...]):
    return knob(default, check=lambda v: v in allowed, allowed="one of " + ", ".join(allowed))


@dataclasses.dataclass(frozen=True)
class EncodersConfig:
    device: str = _dtype_knob("auto", ("auto", "cpu", "cuda"))
    text_dtype: str = _dtype_knob("auto", ("auto", "bf16", "fp16", "fp32"))
    text_precision: Literal["keep", "int8", "fp8", "fp8-compute"] = knob(
        "keep", help="the text encoder's layer linears: keep (encoders.text_dtype) | int8 | fp8 "
                     "(weight-only codes) | fp8-compute (fp8 GEMMs, sm89+)")
    text_stream: Literal["auto", "on", "off"] = knob(
        "auto", help="stream the text encoder's layers through device slots from host memory: "
                     "auto when its weights do not fit the free device memory (docs/memory.md)")
    vae_dtype: str = _dtype_knob("auto", ("auto", "bf16", "fp16", "fp32"))
    draw: Literal["mode", "sample"] = "mode"
    text_batch: int = knob(32, check=lambda v: v >= 1, allowed="an integer >= 1 (captions per call)")
    text_batch_tokens: int = knob(16384, check=lambda v: v >= 0,
                                  allowed="an integer >= 0 (padded tokens per call, 0 = no cap)")
    vae_batch: int = knob(8, check=lambda v: v >= 1, allowed="an integer >= 1 (images per call)")
    vae_batch_pixels: int = knob(4 * 1024 * 1024, check=lambda v: v >= 256,
                                 allowed="an integer >= 256 (pixels per call)")
    decode_workers: int = knob(2, check=lambda v: v >= 1, allowed="an integer >= 1 (image decode threads)")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    text: Literal["offline", "online", "off"] = "offline"
    latents: Literal["offline", "online", "off"] = "offline"
    dtype: Literal["bf16", "fp16", "fp32", "fp8"] = "bf16"
    shard_mb: int = knob(256, check=lambda v: v >= 1, allowed="an integer >= 1 (MiB per shard)")


ALGOS = ("lora", "locon", "loha", "lokr", "dora", "oft", "boft", "glora", "ia3", "dylora", "tlora",
         "full")


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """What is trained: a LyCORIS algorithm on the preset's (or ``targets``') linears, or
    ``full`` (every weight). ``dora`` adds weight decomposition to lora/locon/loha/lokr;
    ``algo: dora`` is LoRA with it."""

    algo: str = knob("lora", check=lambda v: v in ALGOS, allowed="one of " + ", ".join(ALGOS))
    preset: str = knob("attn-mlp", help="attn | attn-mlp | full-block | all, plus modifiers "
                                        "+text-refiner +modulation +embed")
    targets: tuple[str, ...] = knob((), help="explicit module-path regexes; replace the preset")
    dim: int = knob(32, check=lambda v: v >= 1, allowed="an integer >= 1")
    alpha: float = knob(32.0, check=lambda v: v >= 0, allowed="a number >= 0")
    dora: bool = False
    algo_kwargs: dict = knob({}, help="extra keyword arguments of the LyCORIS module")
    dropout: float = knob(0.0, check=lambda v: 0 <= v < 1, allowed="a probability in [0, 1)")
    rank_dropout: float = knob(0.0, check=lambda v: 0 <= v < 1, allowed="a probability in [0, 1)")
    module_dropout: float = knob(0.0, check=lambda v: 0 <= v < 1, allowed="a probability in [0, 1)")
    mode: Literal["bypass", "merge"] = "bypass"
    loraplus_ratio: float = knob(1.0, check=lambda v: v > 0, allowed="a number > 0 (1 = off)")
    train_norms: bool = False
    # learning-rate multipliers by where a trained tensor sits (times optim.lr, and LoRA+'s
    # ratio for the up factors): the joint blocks and the rest, the text refiner, trained norms
    lr_blocks: float = knob(1.0, check=lambda v: v > 0, allowed="a number > 0 (times optim.lr)")
    lr_text_refiner: float = knob(1.0, check=lambda v: v > 0, allowed="a number > 0 (times optim.lr)")
    lr_norms: float = knob(1.0, check=lambda v: v > 0, allowed="a number > 0 (times optim.lr)")

    @property
    def full(self) -> bool:
        """A full finetune (every DiT weight trained) rather than an adapter: decided here only."""
        return self.algo == "full"


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    name: Literal["adamw", "muon", "adamw8bit", "prodigy", "schedulefree", "adafactor"] = "adamw"
    lr: float = knob(1e-4, check=lambda v: v >= 0, allowed="a number >= 0 (0: the weights stay as they are, a sanity check)")
    betas: tuple[float, float] = knob((0.9, 0.999), check=lambda v: all(0 <= b < 1 for b in v),
                                      allowed="[beta1, beta2] in [0, 1)")
    eps: float = knob(1e-8, check=lambda v: v > 0, allowed="a number > 0")
    weight_decay: float = knob(0.0, check=lambda v: v >= 0, allowed="a number >= 0")
    decay_rule: Literal["moss", "none", "all"] = "moss"
    muon_lr: float = knob(0.02, check=lambda v: v > 0, allowed="a number > 0")
    muon_momentum: float = knob(0.95, check=lambda v: 0 <= v < 1, allowed="a number in [0, 1)")
    muon_ns_steps: int = knob(5, check=lambda v: v >= 1, allowed="an integer >= 1")
    prodigy_d_coef: float = knob(1.0, check=lambda v: v > 0, allowed="a number > 0")
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = knob(0, check=lambda v: v >= 0, allowed="an integer >= 0")
    min_lr_ratio: float = knob(0.0, check=lambda v: 0 <= v <= 1, allowed="a number in [0, 1]")
    grad_clip: float = knob(1.0, check=lambda v: v >= 0, allowed="a number >= 0 (0 = off)")
    ema: float = knob(0.0, check=lambda v: 0 <= v < 1, allowed="an EMA decay in [0, 1) (0 = off)")


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    timesteps: Literal["moss", "uniform", "logit_normal"] = "moss"
    schedule: Literal["", "tech_report"] = ""
    mu: float = -1.09
    s: float = knob(0.95, check=lambda v: v > 0, allowed="a number > 0")
    cutoff: float | None = knob(0.95, check=lambda v: v is None or 0 < v <= 1,
                                allowed="null or a number in (0, 1]")
    uniform_mix: float = knob(0.01, check=lambda v: 0 <= v <= 1, allowed="a number in [0, 1]")
    p_full: float = knob(0.0, check=lambda v: 0 <= v <= 1, allowed="a number in [0, 1]")
    shift: float = knob(1.0, check=lambda v: v > 0, allowed="a number > 0")
    loss: Literal["mse", "huber", "l1"] = "mse"
    huber_delta: float = knob(1.0, check=lambda v: v > 0, allowed="a number > 0")
    weighting: Literal["none", "x0", "eps", "logit_normal", "min_snr"] = "none"
    weighting_mean: float = 0.0  # logit_normal: the density's location and scale
    weighting_std: float = knob(1.0, check=lambda v: v > 0, allowed="a number > 0")
    snr_gamma: float = knob(5.0, check=lambda v: v > 0, allowed="a number > 0 (min_snr's cap)")


EXPORT_FORMATS = ("comfy", "lycoris", "merged", "diffusers")


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    """What the export stage writes to runs/<name>/export/."""

    formats: tuple[str, ...] = knob(("auto",), check=lambda v: all(
        f in EXPORT_FORMATS + ("auto",) for f in v), allowed="a list of auto, " + ", ".join(EXPORT_FORMATS))
    checkpoint: str = knob("latest", help="'latest' or a step number")
    ema: bool = False
    fused_qkv: bool = knob(True, help="ComfyUI's MOSS-Image layout: fused layers.N.proj.qkv")
    style: Literal["lora_unet", "diffusion_model"] = "lora_unet"
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    strength: float = knob(1.0, help="the adapter strength merged into 'merged' / 'diffusers'")
    rotations: Literal["blocks", "diff"] = knob(
        "blocks", help="OFT/BOFT in the comfy file: native blocks (compact; ComfyUI's strength "
                       "slider is exact at 1 only) or a dense diff (exact at every strength)")


@dataclasses.dataclass(frozen=True)
class ValidationConfig:  # docs/training.md#validation
    every: int = knob(0, check=lambda v: v >= 0, allowed="an integer >= 0 (steps; 0: no validation)")
    # the held-out share of every dataset's images (by a hash of each image's identity: the
    # same images stay out as the catalog grows); a dataset entry's ``validation: true``
    # holds out that whole dataset
    share: float = knob(0.0, check=lambda v: 0.0 <= v < 1.0, allowed="a number in [0, 1)")
    max_samples: int = knob(64, check=lambda v: v >= 1, allowed="an integer >= 1 (held-out images evaluated)")
    # the noise levels each held-out image is evaluated at (one band each, reported apart)
    sigmas: tuple[float, ...] = knob((0.1, 0.3, 0.5, 0.7, 0.9), check=lambda v: len(v) >= 1 and all(
        0.0 < s < 1.0 for s in v), allowed="a non-empty list of noise levels in (0, 1)")


@dataclasses.dataclass(frozen=True)
class PreviewConfig:
    """Sample images during training: every ``every`` steps (0 = off), fixed prompts and seeds."""

    every: int = knob(0, check=lambda v: v >= 0, allowed="an integer >= 0 (steps; 0 = off)")
    prompts: tuple[str, ...] = ()
    seeds: tuple[int, ...] = (0,)
    width: int = knob(1024, check=lambda v: v >= 16 and v % 16 == 0, allowed="a multiple of 16")
    height: int = knob(1024, check=lambda v: v >= 16 and v % 16 == 0, allowed="a multiple of 16")
    steps: int = knob(50, check=lambda v: v >= 1, allowed="an integer >= 1")
    cfg: float = knob(3.0, check=lambda v: v >= 0, allowed="a number >= 0")
    shift: float = knob(5.0, check=lambda v: v > 0, allowed="a number > 0")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = knob(100, check=lambda v: v >= 1, allowed="an integer >= 1")
    grad_accum: int = knob(1, check=lambda v: v >= 1, allowed="an integer >= 1")
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    device: str = knob("auto", check=lambda v: v in ("auto", "cpu", "cuda"),
                       allowed="one of auto, cpu, cuda")
    checkpoint_every: int = knob(50, check=lambda v: v >= 1, allowed="an integer >= 1 (steps)")
    keep_checkpoints: int = knob(3, check=lambda v: v >= 1, allowed="an integer >= 1")
    log_every: int = knob(1, check=lambda v: v >= 1, allowed="an integer >= 1 (steps)")


@dataclasses.dataclass(frozen=True)
class KernelsConfig:
    """Which kernel computes each op (``docs/engines.md#tuning``): ``kmoss tune_kernels``
    times every backend on the plan's shapes; train uses the table when it matches the device."""

    table: Literal["auto", "off"] = knob(
        "auto", help="auto: tune and use the fastest backend per shape; off: reference kernels")
    tune_seconds: float = knob(60.0, check=lambda v: v >= 0,
                               allowed="a number >= 0 (seconds kmoss tune_kernels may spend)")
    # 0 by default: choices measured at train time depend on timing, so two runs of the same
    # params could pick different kernels and differ in the last bits; the table that
    # `kmoss tune_kernels` writes is the same input to every run
    retune_seconds: float = knob(0.0, check=lambda v: v >= 0,
                                 allowed="a number >= 0 (seconds train may spend on shapes the "
                                         "table lacks; 0 = reference kernels for them)")
    backends: tuple[str, ...] = knob((), help="backend names the tuner may pick (e.g. [compile, "
                                              "triton]); [] = every registered backend")


PROFILES = ("speed", "balanced", "low", "minimal", "auto", "manual")
"""The top-level ``profile``: the memory engines a training run uses (``docs/memory.md``);
``manual`` takes them from the ``memory:`` section instead."""


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    """The memory engines, set by hand (``profile: manual``; any other profile sets them
    itself and a ``memory:`` section beside it is refused)."""

    checkpointing: Literal["none", "block", "sub-block", "selective", "partial"] = knob(
        "none", help="activation checkpointing of the repeated blocks (docs/memory.md)")
    checkpoint_blocks: int = knob(0, check=lambda v: v >= 0,
                                  allowed="an integer >= 0 (partial: blocks of each list "
                                          "checkpointed, from the first)")
    recompute: bool = knob(True, help="recompute the elementwise references' fp32 "
                                      "intermediates in backward instead of keeping them")
    stream_slots: int = knob(0, check=lambda v: v >= 0,
                             allowed="an integer >= 0 (0: the base's weights stay on the device; N: its "
                                     "block weights live in host memory and stream through N block-sized device slots)")
    optimizer: Literal["device", "host", "fused", "streamed"] = knob(
        "device", help="host: gradients offloaded, states and update on the CPU; fused: the step "
                       "in backward; streamed: states from the host (docs/memory.md)")
    offload: bool = False  # checkpointing block/sub-block: the kept inputs wait in host memory
    rebuild: bool = False  # checkpointing none/partial: the elementwise outputs rebuilt in backward
    fp8_transposes: bool = False  # fp8_compute full: the codes' transposes kept between steps (+ their bytes)


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:  # fp16 training, a quantized frozen base, fp8 compute (docs/precision.md)
    loss_scale: Literal["auto", "dynamic", "off"] = "auto"  # auto: dynamic with train.dtype fp16
    init_scale: float = knob(65536.0, check=lambda v: v > 0, allowed="a number > 0 (2^16)")
    growth_interval: int = knob(2000, check=lambda v: v >= 1, allowed="an integer >= 1 (steps)")
    stream_scale: float | None = knob(
        None, check=lambda v: v is None or (v > 0 and math.log2(v) == int(math.log2(v))),
        allowed="null (2^-8 with fp16, 1 otherwise) or a power of two (the joint residual stream "
                "is carried times this, exactly undone by the norms)")
    base: Literal["keep", "int8", "fp8"] = "keep"  # the frozen base's block linears (docs/precision.md)
    fp8_compute: Literal["off", "on", "full", "fast"] = "off"  # fp8 GEMMs (sm89+, fp8 base); full: dgrad too


@dataclasses.dataclass(frozen=True)
class ParallelConfig:  # docs/parallel.md
    world_size: int = knob(1, check=lambda v: v >= 1, allowed="an integer >= 1 (data-parallel ranks)")
    nodes: int = knob(1, check=lambda v: v >= 1, allowed="an integer >= 1 (world_size / nodes each)")
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl on CUDA, gloo on the CPU
    rdzv_endpoint: str = ""  # host:port of the rendezvous when nodes > 1
    timeout_s: int = knob(1800, check=lambda v: v >= 10, allowed="an integer >= 10 (seconds)")
    # how the work is shared (docs/parallel.md): ddp, every rank the whole model and the
    # gradients summed; fsdp, a full finetune's weights, gradients and optimizer states
    # sharded (FSDP2); threaded, one process whose joint blocks are split over ``devices``
    # by their free memory; auto: fsdp for a full finetune over ranks, ddp for an adapter
    mode: Literal["auto", "ddp", "fsdp", "threaded"] = "auto"
    devices: tuple[str, ...] = knob((), check=lambda v: all(
        d == "cpu" or d == "cuda" or (d.startswith("cuda:") and d[5:].isdigit()) for d in v),
        allowed="a list of devices: cpu, cuda or cuda:N (parallel.mode: threaded, the first "
                "one train.device's)")


def parallel_mode(params) -> str:
    """How ``params`` share the work: ``single`` (one rank, one device), ``threaded`` (one
    process, the joint blocks split over ``parallel.devices``), ``ddp`` (every rank the whole
    model, the gradients summed) or ``fsdp`` (a full finetune sharded); ``parallel.mode:
    auto`` is fsdp for a full finetune and ddp for an adapter."""
    par = params.parallel
    if par.mode == "threaded":
        return "threaded"
    if par.world_size == 1:
        return "single"
    if par.mode == "auto":
        return "fsdp" if params.adapter.full else "ddp"
    return par.mode


SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "data": DataConfig,
    "resolution": ResolutionConfig,
    "caption": CaptionConfig,
    "batching": BatchingConfig,
    "model": ModelConfig,
    "encoders": EncodersConfig,
    "cache": CacheConfig,
    "adapter": AdapterConfig,
    "optim": OptimConfig,
    "objective": ObjectiveConfig,
    "preview": PreviewConfig,
    "validation": ValidationConfig,
    "export": ExportConfig,
    "train": TrainConfig,
    "kernels": KernelsConfig,
    "parallel": ParallelConfig,
    "memory": MemoryConfig,
    "precision": PrecisionConfig,
}
TOP_LEVEL = {"profile": PROFILES}  # scalar keys of params.yaml beside the sections


@dataclasses.dataclass(frozen=True)
class Params:
    run: RunConfig
    data: DataConfig
    resolution: ResolutionConfig
    caption: CaptionConfig
    batching: BatchingConfig
    model: ModelConfig
    encoders: EncodersConfig
    cache: CacheConfig
    adapter: AdapterConfig
    optim: OptimConfig
    objective: ObjectiveConfig
    preview: PreviewConfig
    validation: ValidationConfig
    export: ExportConfig
    train: TrainConfig
    kernels: KernelsConfig
    parallel: ParallelConfig
    memory: MemoryConfig = MemoryConfig()
    precision: PrecisionConfig = PrecisionConfig()
    profile: str = "auto"
    path: str = "params.yaml"


def section_plain(params: Params, name: str) -> dict[str, Any]:
    return to_plain(getattr(params, name))


def stage_params(params: Params, keys: list[str]) -> dict[str, Any]:
    """The params a stage reads, as plain data: ``keys`` are ``section`` or ``section.key``.

    This is what the stage's manifest hashes, and it must list the same keys as the
    stage's ``params:`` in dvc.yaml (a test checks that).
    """
    out: dict[str, Any] = {}
    for key in keys:
        section, _, field = key.partition(".")
        plain = section_plain(params, section)
        out[key] = plain[field] if field else plain
    return out
