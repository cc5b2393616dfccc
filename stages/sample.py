"""`kmoss sample`: images from prompts with the base model, adapter files or checkpoints."""

from __future__ import annotations

import re
import time
from collections.abc import Collection
from pathlib import Path

import typer

from kohakumoss.errors import KohakuError
from stages.common import PARAMS_OPTION, console, stage

SIZE = re.compile(r"(\d+)x(\d+)")


class OptionError(KohakuError, ValueError):
    """A bad command-line value; the message names the option, the value and the allowed form."""


def parse_size(value: str, option: str = "--size") -> tuple[int, int]:
    """``WIDTHxHEIGHT``, both sides positive multiples of 16 (what the sampler takes)."""
    m = SIZE.fullmatch(value.strip().lower())
    w, h = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    if not m or w % 16 or h % 16 or min(w, h) < 16:
        raise OptionError(f"{option} {value!r}: expected WIDTHxHEIGHT with both sides positive "
                          f"multiples of 16, e.g. 1024x1024 or 832x1216")
    return w, h


def check_adapters(specs: list[str], option: str = "--adapter") -> None:
    """Each ``PATH[:STRENGTH]`` names an existing checkpoint folder or adapter file."""
    from kohakumoss.generate import split_strength
    from kohakumoss.formats.checkpoint import is_checkpoint

    for spec in specs:
        path = split_strength(spec)[0]
        if not path.exists():
            problem = "does not exist"
        elif path.is_dir() and not is_checkpoint(path):
            problem = "is a folder but not a training checkpoint"
        else:
            continue
        raise OptionError(f"{option} {spec!r}: {path} {problem}; expected PATH[:STRENGTH] with "
                          f"PATH a checkpoint folder (runs/<name>/checkpoints/step-N) or an "
                          f"adapter file (.safetensors)")


def check_choice(value: str, allowed: Collection[str], option: str) -> str:
    if value not in allowed:
        raise OptionError(f"{option} {value!r}: one of {', '.join(allowed)}")
    return value


def check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise OptionError(f"--{name} {value}: expected a whole number >= 1")


@stage
def main(
    prompt: list[str] = typer.Option([], "--prompt", "-P", help="A prompt (repeatable)."),
    prompts_file: Path = typer.Option(None, help="A text file with one prompt per line."),
    params: Path = PARAMS_OPTION,
    kernels: Path = typer.Option(Path("artifacts/kernels"), help="Kernel tuning table directory "
                                 "(kmoss tune_kernels): the DiT runs the kernels it chose for this "
                                 "device; none there: the reference kernels."),
    adapter: list[str] = typer.Option([], "--adapter", "-a",
                                      help="PATH[:STRENGTH]: a checkpoint dir or an adapter file "
                                           "(ours, LyCORIS, ComfyUI); repeatable."),
    size: str = typer.Option("1024x1024", help="WIDTHxHEIGHT, multiples of 16."),
    steps: int = typer.Option(50, help="Sampling steps."),
    cfg: float = typer.Option(3.0, help="Guidance scale (1 = no negative branch)."),
    shift: float = typer.Option(5.0, help="Schedule shift."),
    negative: str = typer.Option("", help="Negative prompt ('' = the empty caption)."),
    seed: int = typer.Option(0, help="Seed of the first image; image i uses seed + i."),
    count: int = typer.Option(1, help="Images per prompt."),
    batch: int = typer.Option(4, help="Images per sampling batch."),
    dtype: str = typer.Option("bf16", help="DiT compute dtype: bf16, fp16 or fp32."),
    out: Path = typer.Option(Path("samples"), help="Output folder."),
) -> None:
    """Sample images the way the official pipeline does (shifted schedule, Euler, CFG with the
    negative branch skipping the configured block). Writes one PNG per image with its
    settings in the metadata, and a contact sheet."""
    from kohakumoss.params import load_params
    from kohakumoss.progress import progress
    from kohakumoss.generate import Generator, Settings, contact_sheet, save_png
    from kohakumoss.device import resolve_device
    from kohakumoss.precision import DTYPES

    if prompts_file is not None and not prompts_file.is_file():
        raise OptionError(f"--prompts-file {prompts_file}: no such file; expected a text file with "
                          f"one prompt per line")
    prompts = list(prompt) + ([ln.strip() for ln in prompts_file.read_text().splitlines() if ln.strip()]
                              if prompts_file else [])
    if not prompts:
        raise OptionError("no prompt: give at least one --prompt (-P) or a --prompts-file")
    w, h = parse_size(size)
    check_positive(steps=steps, count=count, batch=batch)
    check_choice(dtype, DTYPES, "--dtype")
    check_adapters(adapter)
    p = load_params(params)
    device = resolve_device(p.encoders.device)
    dt = DTYPES[dtype]
    gen = Generator(p, device, dt, adapter, kernels=kernels)
    s = Settings(w, h, steps, cfg, shift, negative)
    jobs = [(pr, seed + i) for i, pr in enumerate(pr for pr in prompts for _ in range(count))]
    images, labels = [], []
    out.mkdir(parents=True, exist_ok=True)
    console.print(f"sampling {len(jobs)} image(s) at {w}x{h}, {steps} steps, cfg {cfg} on {device} "
                  f"({p.model.transformer} transformer) into {out}/", highlight=False)
    if device.type == "cpu" and w * h * steps > 256 * 256 * 20:
        console.print(f"[yellow]note:[/] on the CPU each image runs {steps} steps "
                      f"{'twice ' if cfg != 1 else ''}at {w}x{h}: this takes minutes "
                      f"(--size 256x256 --steps 20 takes seconds)", highlight=False)
    every = progress(len(jobs), "images", "image")
    for j, (pr, sd) in enumerate(jobs):
        t0 = time.perf_counter()
        with progress(steps, f"image {j + 1}", "step", leave=False) as bar:
            img = gen.images([pr], [sd], s, batch=batch, progress=lambda i, n: bar.update(1))[0]
        every.update(1)
        meta = {"prompt": pr, "negative": negative, "seed": sd, "width": w, "height": h,
                "steps": steps, "cfg": cfg, "shift": shift, "adapters": list(adapter),
                "transformer": p.model.transformer, "dtype": dtype,
                "seconds": round(time.perf_counter() - t0, 3)}
        save_png(img, out / f"{j:04d}-seed{sd}.png", meta)
        images.append(img)
        labels.append(f"{sd}: {pr}")
    every.close()
    sheet = contact_sheet(images, labels)
    sheet.save(out / "contact_sheet.png")
    console.print(f"{len(images)} image(s) and a contact sheet in {out}")


if __name__ == "__main__":
    typer.run(main)
