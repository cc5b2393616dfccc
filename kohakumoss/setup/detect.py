"""What ``kmoss config`` finds: the MOSS-Image weights in a Hugging Face pipeline folder or a
ComfyUI ``models/`` folder, and the kind of a dataset path (``docs/config.md``).

Everything is read from file headers and folder listings: nothing is loaded.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from safetensors import SafetensorError, safe_open

from kohakumoss.configlib import ConfigError
from kohakumoss.data.sources.base import is_image_name

TINY = "tiny"
DEMO_SCRIPT = "examples/make_demo_model.py"  # the demo pipeline's maker, in its model_index.json (docs/demo.md)
WEIGHTS_HELP = ("give 'tiny', a MOSS-Image pipeline folder (model_index.json with transformer/, "
                "text_encoder/, vae/ and tokenizer/) or a ComfyUI models/ folder (diffusion_models/, "
                "text_encoders/, vae/)")
# ComfyUI's folders for each component (the older names too)
COMFY_FOLDERS = {"transformer": ("diffusion_models", "unet"), "text_encoder": ("text_encoders", "clip"),
                 "vae": ("vae",)}


@dataclasses.dataclass
class Found:
    """The weights found: the params' ``model`` values, and what was seen on the way."""

    layout: str  # tiny | pipeline | comfy
    transformer: str = TINY
    text_encoder: str = TINY
    vae: str = TINY
    tokenizer: str = ""  # model.tokenizer
    caption_tokenizer: str = TINY  # caption.tokenizer: exact token counts
    quantized: str = ""  # the transformer file's format: int8 | fp8 | "" (precision.base can keep it)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def tiny(self) -> bool:
        """The random tiny components or the demo pipeline: small models a CPU trains."""
        return self.layout in (TINY, "demo")


def is_demo(value: str) -> bool:
    """``value`` is the demo pipeline (its ``model_index.json`` names the script that made it)."""
    index = Path(value).expanduser() / "model_index.json"
    try:
        return json.loads(index.read_text(encoding="utf-8")).get("_made_by") == DEMO_SCRIPT
    except (OSError, ValueError, AttributeError):
        return False


def header(path: Path) -> dict[str, str]:
    """A safetensors file's tensor names and their dtypes (``BF16``, ``I8``, ``F8_E4M3``...),
    read from its header only."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_slice(k).get_dtype() for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"{path}: not a readable .safetensors file ({e})") from None


def quantization(head: dict[str, str]) -> str:
    """``int8``, ``fp8`` or ``""``: how a ComfyUI file stores its linear weights."""
    dtypes = {dtype for k, dtype in head.items() if k.endswith(".weight")}
    if "I8" in dtypes:
        return "int8"
    if dtypes & {"F8_E4M3", "F8_E5M2"}:
        return "fp8"
    return ""


def _is_transformer(path: Path) -> bool:
    from kohakumoss.formats.model_files import read_config

    try:
        read_config(path)
    except (ValueError, OSError):
        return False
    return True


def _is_text_encoder(head: dict[str, str]) -> bool:
    names = list(head)
    return (any(n.endswith("embed_tokens.weight") for n in names)
            and any(".linear_attn." in n for n in names))  # Qwen3.5's Gated DeltaNet layers


def _is_vae(head: dict[str, str]) -> bool:
    names = set(head)
    return any(n.startswith(("encoder.", "vae.encoder.", "first_stage_model.encoder.")) for n in names) \
        and any(".decoder." in "." + n for n in names)


def _choose(kind: str, candidates: list[Path], found: Found) -> str:
    """The file to use among a component's candidates: unquantized first, then by name; the
    rest are noted. A quantized transformer is recorded (``Found.quantized``); a quantized
    text encoder or VAE is dequantized on load."""
    if not candidates:
        return ""
    quant = {p: quantization(header(p)) for p in candidates}
    ranked = sorted(candidates, key=lambda p: (quant[p] != "", p.name))
    for other in ranked[1:]:
        found.notes.append(f"{kind}: also found {other.name}{f' ({quant[other]})' if quant[other] else ''}")
    q = quant[ranked[0]]
    if q and kind == "transformer":
        found.quantized = q  # the preset decides whether the codes are kept (precision.base)
    elif q:
        found.notes.append(f"{kind}: {ranked[0].name} is {q}-quantized (ComfyUI's layout); it is "
                           f"dequantized to the compute dtype on load")
    return str(ranked[0])


def _comfy_root(path: Path) -> Path | None:
    """The ``models/`` folder under ``path`` (ComfyUI's root, or models/ itself)."""
    for root in (path, path / "models"):
        if any((root / f).is_dir() for names in COMFY_FOLDERS.values() for f in names):
            return root
    return None


def find_weights(value: str) -> Found:
    """The weights at ``value`` (``tiny``, a pipeline folder, a ComfyUI ``models/`` folder or
    ComfyUI's root): the params' model paths, or a ConfigError naming what is missing."""
    if value == TINY:
        return Found(TINY)
    path = Path(value).expanduser()
    if not path.exists():
        raise ConfigError(f"--weights {value}: does not exist; {WEIGHTS_HELP}")
    if not path.is_dir():
        raise ConfigError(f"--weights {value}: is a file; {WEIGHTS_HELP} (a single file is set "
                          f"with `dvc exp run -S model.transformer=...`)")
    if (path / "model_index.json").is_file() or (path / "transformer").is_dir():
        missing = [d for d in ("transformer", "text_encoder", "vae") if not (path / d).is_dir()]
        if missing:
            raise ConfigError(f"--weights {value}: a pipeline folder without {', '.join(f'{m}/' for m in missing)}; "
                              f"{WEIGHTS_HELP}")
        tok = path / "tokenizer"
        found = Found("demo" if is_demo(value) else "pipeline", str(path), str(path), str(path), "",
                      str(tok) if tok.is_dir() else "")
        if not tok.is_dir():
            found.notes.append(f"no {tok}: caption token counts are estimated (set caption.tokenizer)")
        return found
    root = _comfy_root(path)
    if root is None:
        raise ConfigError(f"--weights {value}: neither a pipeline folder (no model_index.json or "
                          f"transformer/) nor a ComfyUI models/ folder; {WEIGHTS_HELP}")
    found = Found("comfy")
    files = {kind: sorted(f for d in dirs for f in (root / d).glob("*.safetensors") if f.is_file())
             for kind, dirs in COMFY_FOLDERS.items()}
    found.transformer = _choose("transformer", [f for f in files["transformer"] if _is_transformer(f)], found)
    found.text_encoder = _choose("text encoder", [f for f in files["text_encoder"]
                                                  if _is_text_encoder(header(f))], found)
    found.vae = _choose("vae", [f for f in files["vae"] if _is_vae(header(f))], found)
    missing = [f"a MOSS-Image transformer in {'/'.join(COMFY_FOLDERS['transformer'])}/"
               if not found.transformer else "",
               f"a Qwen3.5 text encoder in {'/'.join(COMFY_FOLDERS['text_encoder'])}/"
               if not found.text_encoder else "",
               "a FLUX.2 VAE in vae/" if not found.vae else ""]
    if any(missing):
        raise ConfigError(f"--weights {value}: {root} has no {', no '.join(m for m in missing if m)} "
                          f"(.safetensors files are read by their keys, whatever their names); "
                          f"{WEIGHTS_HELP}")
    # the tokenizer the text encoder's loader finds beside it also counts caption tokens
    te = Path(found.text_encoder).parent
    tok = next((d for d in (te / "tokenizer", te.parent / "tokenizer") if d.is_dir()), None)
    found.caption_tokenizer = str(tok) if tok else ""
    if tok is None:
        found.notes.append(f"no tokenizer/ beside {te}: pass --tokenizer (the text encoder needs "
                           f"one); caption token counts are estimated")
    return found


# -- data --------------------------------------------------------------------------------------
KOHYA_FOLDER = re.compile(r"^\d+_.+")


def _images_under(path: Path, limit: int = 1) -> bool:
    seen = 0
    for p in path.rglob("*"):
        if p.is_file() and is_image_name(p.name):
            seen += 1
            if seen >= limit:
                return True
    return False


def find_data(value: str) -> tuple[dict, str]:
    """A ``data.datasets`` entry for ``value`` and why that source kind: a kohya folder
    (``N_name/`` subfolders), a folder of images with caption sidecars, webdataset tars (a
    .tar, a glob, or a folder of them), a parquet or jsonl file, or a converted dataset
    (``shards/``)."""
    help_ = ("give a folder of images (with .txt/.json caption sidecars), a kohya folder (N_name/ "
             "subfolders), .tar shards or a glob of them, a .parquet or .jsonl file, or a "
             "converted dataset folder (shards/); docs/data.md lists every source")
    if any(c in value for c in "*?["):
        return {"source": "webdataset", "path": value}, "a glob of tar shards"
    path = Path(value).expanduser()
    if not path.exists():
        raise ConfigError(f"--data {value}: does not exist; {help_}")
    if path.is_file():
        kinds = {".tar": "webdataset", ".parquet": "parquet", ".jsonl": "jsonl"}
        if path.suffix not in kinds:
            raise ConfigError(f"--data {value}: a {path.suffix or 'suffix-less'} file; {help_}")
        return {"source": kinds[path.suffix], "path": value}, f"a {path.suffix} file"
    if (path / "shards").is_dir():
        return {"source": "moss_shard", "path": value}, "a converted dataset (shards/)"
    subdirs = [d for d in path.iterdir() if d.is_dir()]
    if any(KOHYA_FOLDER.match(d.name) for d in subdirs):
        return ({"source": "kohya", "path": value, "repeat_prefix": "first", "txt_as": "tags"},
                "kohya folders (N_name: N repeats per epoch)")
    tars = sorted(path.glob("*.tar"))
    if tars:
        return {"source": "webdataset", "path": str(path / "*.tar")}, f"{len(tars)} tar shards"
    for suffix, kind in ((".parquet", "parquet"), (".jsonl", "jsonl")):
        files = sorted(path.glob(f"*{suffix}"))
        if len(files) == 1:
            return {"source": kind, "path": str(files[0])}, f"one {suffix} file"
    if _images_under(path):
        return {"source": "folder", "path": value, "txt_as": "tags"}, "a folder of images"
    raise ConfigError(f"--data {value}: no images, shards, parquet or jsonl file found there; {help_}")
