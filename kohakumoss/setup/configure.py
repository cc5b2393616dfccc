"""``kmoss config``: a ``params.yaml`` for this card, these weights and this data
(``docs/config.md``).

The params file is edited in place, comments and order kept (``ruamel.yaml``'s round
trip): the weights found (``kohakumoss.setup.detect``), the dataset's source, the run's
name and adapter, a recipe's settings (``recipes/*.yaml``), and a card preset's profile,
token budget, resolution and encoder placement. The result is checked as every stage
checks it (``load_params``), and the memory estimator says what the step will need, before
anything is written. An existing file is replaced only with ``force``, its old text kept
beside it as ``<name>.bak``.
"""

from __future__ import annotations

import dataclasses
import io
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from ruamel.yaml import YAML
from ruamel.yaml.scalarstring import SingleQuotedScalarString

from kohakumoss.artifacts import atomic_path
from kohakumoss.configlib import ConfigError
from kohakumoss.setup.detect import TINY, Found, find_data, find_weights, is_demo

TEMPLATE = Path(__file__).with_name("params.yaml")  # the repository's params.yaml (a test keeps them equal)
MP_TOKENS = 4096  # image tokens of a 1 MP sample (16x16 pixels per token)


@dataclasses.dataclass(frozen=True)
class Preset:
    """What ``--vram`` sets (``docs/config.md, "Presets"``)."""

    vram_gib: int
    profile: str
    samples: int  # 1 MP samples per step: batching.max_tokens holds this many and their captions
    text_stream: str  # encoders.text_stream (the 15.6 GiB text encoder beside nothing else)
    full: bool = False  # a full finetune (adapter.algo: full)

    @property
    def max_tokens(self) -> int:
        return self.samples * (MP_TOKENS + 512)  # room for captions up to 512 tokens each


PRESETS: dict[str, Preset] = {
    "6": Preset(6, "minimal", 1, "on"),
    "8": Preset(8, "minimal", 2, "on"),
    "12": Preset(12, "low", 2, "on"),
    "16": Preset(16, "low", 4, "on"),
    "24": Preset(24, "auto", 4, "auto"),
    "24-full": Preset(24, "low", 1, "auto", full=True),
}
VRAM_CHOICES = ("auto", *PRESETS)
YAML11_BOOLEANS = {"on", "off", "yes", "no", "y", "n", "true", "false"}
DEFAULT_RECIPE = {False: "lora-1mp", True: "full-1mp"}  # real weights, no --from: by adapter kind


@dataclasses.dataclass
class Report:
    """What ``configure`` did and why, line by line (the command prints it)."""

    lines: list[str] = dataclasses.field(default_factory=list)
    written: Path | None = None
    backup: Path | None = None
    text: str = ""
    preset: Preset | None = None  # the card preset applied
    cards: tuple[float, ...] = ()  # several cards' GiB (``--vram 12,11``): a threaded split

    def say(self, line: str) -> None:
        self.lines.append(line)


def card_vram_gib() -> float | None:
    """The first CUDA device's total memory in GiB, None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / 2**30


def card_has_bf16() -> bool:
    """Whether the first CUDA device computes in bf16 (Ampere on; V100, T4, RTX 20xx do not)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def preset_for(vram: str, report: Report, card: Callable[[], float | None] = card_vram_gib,
               full: bool = False) -> Preset | None:
    """The preset ``vram`` names; ``auto``: the largest whose size the card reaches (the
    full-finetune one only with ``full``), None without a card."""
    if vram != "auto":
        if vram not in PRESETS:
            raise ConfigError(f"--vram {vram!r}: one of {', '.join(VRAM_CHOICES)}")
        return PRESETS[vram]
    total = card()
    if total is None:
        report.say("vram: auto found no CUDA device; the profile stays as it is (pass --vram "
                   f"{'|'.join(PRESETS)} to size the run for a card)")
        return None
    name = _preset_name(total, full)
    report.say(f"vram: auto read {total:.1f} GiB on cuda:0: preset {name}")
    return PRESETS[name]


def _cards(vram: str) -> tuple[float, ...]:
    """``--vram 12,11``: each card's GiB."""
    try:
        cards = tuple(float(v) for v in vram.split(","))
    except ValueError:
        cards = ()
    if len(cards) < 2 or min(cards) <= 0:
        raise ConfigError(f"--vram {vram!r}: several cards are their sizes in GiB, comma-separated "
                          f"(e.g. 12,11 for a 12 GB and an 11 GB card)")
    return cards


def _preset_name(gib: float, full: bool) -> str:
    """The largest preset a card of ``gib`` reaches (the full-finetune one with ``full``)."""
    fitting = [k for k, p in PRESETS.items() if p.vram_gib <= gib + 0.5 and p.full == full]
    return max(fitting, key=lambda k: PRESETS[k].vram_gib) if fitting else "6"


# -- the document ----------------------------------------------------------------------------
def _yaml() -> YAML:
    y = YAML()
    y.preserve_quotes = True
    y.width = 4096  # never re-wrap a long comment or list
    y.indent(mapping=2, sequence=4, offset=2)  # params.yaml's own style
    return y


def _load(path: Path) -> Any:
    try:
        return _yaml().load(path.read_text(encoding="utf-8"))
    except Exception as e:  # ruamel's parser errors carry the line
        raise ConfigError(f"{path}: not valid YAML ({e})") from None


def set_key(doc, dotted: str, value: Any) -> None:
    """``doc[a][b] = value`` for ``"a.b"``, creating missing sections; a string YAML 1.1
    would read as a boolean (``on``) is written quoted."""
    if isinstance(value, str) and value.lower() in YAML11_BOOLEANS:
        value = SingleQuotedScalarString(value)
    *parents, last = dotted.split(".")
    node = doc
    for key in parents:
        if node.get(key) is None:
            node[key] = {}
        node = node[key]
    node[last] = value


def merge(doc, patch: dict) -> None:
    """``patch``'s values into ``doc``, mapping into mapping (a list is replaced whole)."""
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            merge(doc[key], value)
        else:
            doc[key] = value


def find_recipe(name: str, root: Path) -> Path:
    """A recipe file: a path, or ``recipes/<name>.yaml`` beside the params file."""
    for path in (Path(name), root / "recipes" / f"{name}.yaml", root / "recipes" / name):
        if path.is_file():
            return path
    have = sorted(p.stem for p in (root / "recipes").glob("*.yaml"))
    raise ConfigError(f"--from {name!r}: no such recipe file; recipes in {root / 'recipes'}: "
                      f"{', '.join(have) or 'none'} (or give a .yaml path)")


def _dump(doc) -> str:
    out = io.StringIO()
    _yaml().dump(doc, out)
    return out.getvalue()


# -- the command's work ----------------------------------------------------------------------
def configure(params: Path, *, weights: str | None = None, data: str | None = None,
              name: str | None = None, algo: str | None = None, vram: str | None = None,
              recipe: str | None = None, tokenizer: str | None = None, force: bool = False,
              card: Callable[[], float | None] = card_vram_gib,
              bf16: Callable[[], bool] = card_has_bf16) -> Report:
    """Write (or, with ``force``, update) ``params`` (see the module). Raises ConfigError
    for bad input or a refused overwrite, before writing anything."""
    report = Report()
    source = params if params.is_file() else TEMPLATE
    doc = _load(source)
    report.say(f"starting from {source}")
    full = algo == "full" or (algo is None and vram == "24-full")
    found = find_weights(weights) if weights is not None else None
    if recipe is None and found is not None and not found.tiny:
        recipe = DEFAULT_RECIPE[full]
    if recipe is not None:
        path = find_recipe(recipe, params.parent)
        patch = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        if not isinstance(patch, dict):
            raise ConfigError(f"{path}: a recipe is a mapping of params sections")
        patch.pop("model", None)  # the weights are --weights'
        merge(doc, patch)
        report.say(f"recipe: {path} ({', '.join(patch)})")
    if found is not None:
        for key in ("transformer", "text_encoder", "vae"):
            set_key(doc, f"model.{key}", getattr(found, key))
        set_key(doc, "model.tokenizer", tokenizer if tokenizer is not None else found.tokenizer)
        set_key(doc, "caption.tokenizer", found.caption_tokenizer)
        report.say(f"weights: {found.layout} at {weights}" + "".join(
            f"\n  {k}: {getattr(found, k)}" for k in ("transformer", "text_encoder", "vae")
            if not found.tiny))
        report.lines += [f"  note: {n}" for n in found.notes]
    elif tokenizer is not None:
        set_key(doc, "model.tokenizer", tokenizer)
    if data is not None:
        entry, why = find_data(data)
        set_key(doc, "data.datasets", [entry])
        report.say(f"data: {entry['source']} source at {entry['path']} ({why})")
    if name is not None:
        set_key(doc, "run.name", name)
    if algo is not None:
        set_key(doc, "adapter.algo", algo)
    elif full:
        set_key(doc, "adapter.algo", "full")
    transformer = str((doc.get("model") or {}).get("transformer", TINY))
    tiny = transformer == TINY or is_demo(transformer)
    cards = _cards(vram) if vram is not None and "," in vram else ()
    preset = preset_for(_preset_name(min(cards), full) if cards else vram, report, card, full) \
        if vram is not None else None
    if cards:  # one process, the joint blocks split over the cards by the estimate
        report.cards = cards
        set_key(doc, "parallel.mode", "threaded")
        set_key(doc, "parallel.devices", [f"cuda:{i}" for i in range(len(cards))])
        report.say(f"vram: {len(cards)} cards ({', '.join(f'{c:g}' for c in cards)} GiB): "
                   f"parallel.mode threaded, the joint blocks split over cuda:0-{len(cards) - 1} "
                   f"(docs/parallel.md#threaded); the {preset.vram_gib} GiB preset's budget, "
                   f"profile auto")
        preset = dataclasses.replace(preset, profile="auto")
    if preset is not None:
        # a card read without bf16 (sm70/sm75) trains in fp16, with loss scaling
        dtype = "fp16" if vram == "auto" and card() is not None and not bf16() else "bf16"
        _apply_preset(doc, preset, tiny, report, dtype)
    if found is not None:
        _hold_base(doc, found, report)
    return _finish(params, doc, report, force)


def _hold_base(doc, found: Found, report: Report) -> None:
    """``precision.base`` for the transformer file: its int8 / fp8 codes kept as stored
    (half the weights' memory) when the run can hold them (a LoRA on a profile that does not
    stream the base), else dequantized on load, said why."""
    if not found.quantized:
        return  # an unquantized file: precision.base stays as it is (quantized on load, or kept)
    profile = str(doc.get("profile", "auto"))
    full = (doc.get("adapter") or {}).get("algo") == "full"
    name = Path(found.transformer).name
    if full or profile in ("low", "minimal", "manual"):
        set_key(doc, "precision.base", "keep")
        why = "a full finetune trains the base" if full else \
            f"profile {profile} streams the base's weights, and a quantized base does not stream yet"
        report.say(f"transformer: {name} is {found.quantized}-quantized; it is dequantized on "
                   f"load ({why})")
        return
    set_key(doc, "precision.base", found.quantized)
    report.say(f"transformer: {name} is {found.quantized}-quantized; precision.base: "
               f"{found.quantized} keeps its codes as stored (docs/precision.md#quantized-bases)")


def _apply_preset(doc, preset: Preset, tiny: bool, report: Report, dtype: str = "bf16") -> None:
    from kohakumoss.config import MemoryConfig

    set_key(doc, "profile", preset.profile)
    if isinstance(doc.get("memory"), dict):  # a manual section would be refused beside a profile
        for f in dataclasses.fields(MemoryConfig):
            if f.name in doc["memory"]:
                doc["memory"][f.name] = getattr(MemoryConfig(), f.name)
    if preset.full and (doc.get("adapter") or {}).get("algo") != "full":
        raise ConfigError("--vram 24-full is the full-finetune preset: leave --algo out or "
                          "pass --algo full")
    if tiny:  # the embedded tiny or demo model: its small budget and resolution stay
        report.say(f"preset {preset.vram_gib} GiB: profile {preset.profile} (the tiny model keeps "
                   f"its budget and resolution)")
        return
    set_key(doc, "batching.max_tokens", preset.max_tokens)
    set_key(doc, "resolution.target_area", MP_TOKENS * 256)
    set_key(doc, "encoders.text_stream", preset.text_stream)
    set_key(doc, "encoders.device", "auto")
    set_key(doc, "train.dtype", dtype)
    report.say(f"preset {preset.vram_gib} GiB{' full finetune' if preset.full else ''}: profile "
               f"{preset.profile}, {preset.samples} x 1 MP per step (batching.max_tokens "
               f"{preset.max_tokens}), text encoder streaming {preset.text_stream}, {dtype}"
               + (" (the card has no bf16: fp16 with loss scaling, docs/precision.md)"
                  if dtype == "fp16" else ""))
    report.preset = preset


def _finish(params: Path, doc, report: Report, force: bool) -> Report:
    from kohakumoss.params import load_params

    text = _dump(doc)
    with tempfile.TemporaryDirectory() as tmp:  # checked as a stage checks it, before writing
        trial = Path(tmp) / params.name
        trial.write_text(text, encoding="utf-8")
        try:
            checked = load_params(trial)
        except ConfigError as e:
            raise ConfigError(str(e).replace(str(trial), str(params))) from None
    _estimate(checked, report)
    report.text = text
    if params.is_file():
        old = params.read_text(encoding="utf-8")
        if old == text:
            report.say(f"{params} already says this; nothing written")
            return report
        if not force:
            raise ConfigError(f"{params} exists: pass --force to replace it (its current text is kept "
                              f"as {params.name}.bak)")
        report.backup = params.with_name(params.name + ".bak")
        with atomic_path(report.backup) as tmp:
            Path(tmp).write_text(old, encoding="utf-8")
    with atomic_path(params) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")
    report.written = params
    report.say(f"wrote {params}" + (f" (the previous one is {report.backup})" if report.backup else ""))
    return report


def _estimate(params, report: Report) -> None:
    """The estimator's word on the run: the profile it resolves to on the preset's card."""
    import torch

    from kohakumoss.checks.params import transformer_config
    from kohakumoss.training.autoprofile import resolve_profile
    from kohakumoss.training.catalog import typical_batch
    from kohakumoss.training.estimate import size

    preset = report.preset
    batch, _ = typical_batch(params)  # batching.max_tokens of typical 1-caption samples
    samples, image = len(batch), batch[0][0]
    device = torch.device("cuda" if preset is not None else "cpu")
    free = int(preset.vram_gib * 2**30 * 0.94) if preset is not None else None  # less the CUDA context
    config = transformer_config(params)
    devices = [torch.device("cuda", i) for i in range(len(report.cards))] or None
    cards = [int(c * 2**30 * 0.94) for c in report.cards] or None
    name, engines, est, why = resolve_profile(params, batch, device, free=free, config=config,
                                              devices=devices, device_free=cards)
    where = (f"{len(cards)} cards of {', '.join(f'{c:g}' for c in report.cards)} GiB" if cards
             else f"a {preset.vram_gib} GiB card" if preset is not None else "this machine")
    report.say(f"estimate on {where}: {samples} sample(s) of {image} image tokens per step: {why}")
    report.say(f"  {est.describe()}")
    if cards:
        from kohakumoss.training.autoprofile import HEADROOM, device_split

        split = device_split(params, batch, engines, devices, [int(c * HEADROOM) for c in cards], config)
        report.say(f"  split: {split.describe()}")
        if not split.fits:
            report.say("  warning: a card's share is more than it has: lower batching.max_tokens")
    elif preset is not None and est.peak > free:
        report.say(f"  warning: {size(est.peak)} predicted, more than the card has: lower "
                   f"batching.max_tokens or choose a leaner profile")
