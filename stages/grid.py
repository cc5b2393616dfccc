"""`kmoss grid`: prompts x checkpoints (or x strengths) in one image, to pick the best step."""

from __future__ import annotations

from pathlib import Path

import typer

from stages.common import PARAMS_OPTION, console, stage
from stages.sample import (OptionError, check_adapters, check_choice, check_positive,
                           parse_size)


@stage
def main(
    prompt: list[str] = typer.Option(..., "--prompt", "-P", help="A prompt (repeatable): one row each."),
    adapter: list[str] = typer.Option([], "--adapter", "-a",
                                      help="PATH[:STRENGTH] (repeatable): one column each, e.g. "
                                           "every runs/<name>/checkpoints/step-N."),
    strengths: str = typer.Option("", help="With one --adapter: columns at these strengths, "
                                           "e.g. 0,0.5,1 (0 = the base model)."),
    params: Path = PARAMS_OPTION,
    kernels: Path = typer.Option(Path("artifacts/kernels"), help="Kernel tuning table directory "
                                 "(kmoss tune_kernels): the DiT runs the kernels it chose for this "
                                 "device; none there: the reference kernels."),
    size: str = typer.Option("1024x1024", help="WIDTHxHEIGHT, multiples of 16."),
    steps: int = typer.Option(50), cfg: float = typer.Option(3.0), shift: float = typer.Option(5.0),
    seed: int = typer.Option(0, help="One seed for every cell, so columns compare fairly."),
    dtype: str = typer.Option("bf16", help="DiT compute dtype: bf16, fp16 or fp32."),
    out: Path = typer.Option(Path("samples/grid.png"), help="Output PNG."),
) -> None:
    """Sample every prompt with every adapter variant (same seed) into one labelled grid."""

    from kohakumoss.params import load_params
    from kohakumoss.generate import Generator, Settings, grid, save_png, split_strength
    from kohakumoss.device import resolve_device
    from kohakumoss.precision import DTYPES

    w, h = parse_size(size)
    check_positive(steps=steps)
    check_choice(dtype, DTYPES, "--dtype")
    check_adapters(adapter)
    if strengths:
        if len(adapter) != 1:
            raise OptionError(f"--strengths {strengths!r} needs exactly one --adapter (got "
                              f"{len(adapter)})")
        path = split_strength(adapter[0])[0]
        try:
            values = [float(v) for v in strengths.split(",")]
        except ValueError:
            raise OptionError(f"--strengths {strengths!r}: expected numbers separated by commas, "
                              f"e.g. 0,0.5,1") from None
        variants = [[f"{path}:{v}"] if v else [] for v in values]
        names = [f"x{v:g}" for v in values]
    else:
        variants = [[a] for a in adapter] or [[]]
        names = [Path(split_strength(a)[0]).name for a in adapter] or ["base"]
    p = load_params(params)
    dt = DTYPES[dtype]
    gen = Generator(p, resolve_device(p.encoders.device), dt, kernels=kernels)
    image = grid(gen, prompt, variants, names, seed, Settings(w, h, steps, cfg, shift))
    out.parent.mkdir(parents=True, exist_ok=True)
    save_png(image, out, {"prompts": list(prompt), "columns": names, "seed": seed, "steps": steps,
                          "cfg": cfg, "shift": shift, "size": size})
    console.print(f"grid of {len(prompt)} prompt(s) x {len(variants)} column(s): {out}")


if __name__ == "__main__":
    typer.run(main)
