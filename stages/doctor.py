"""`kmoss doctor`: what this install has and what the params point at."""

from __future__ import annotations

import importlib.metadata as md
import platform
import shutil
from pathlib import Path

import typer
from stages.common import wide_console
from rich.table import Table

PACKAGES = ("torch", "transformers", "diffusers", "lycoris-lora", "safetensors", "pyarrow",
            "pillow", "dvc", "dvclive", "typer")
KERNEL_PACKAGES = {  # optional: each adds kernel backends the tuner then times
    "triton": "the fused kernels of sm80+ cards: pip install triton",
    "tilelang": "the fused kernels of sm70/sm75 cards: pip install tilelang",
    "flash-attn-4": "FlashAttention-4's attention on sm90-sm110: pip install 'kohakumoss[fa4]'",
    "torchao": "optim.name: adamw8bit: pip install -e '.[eightbit]'",
}
INSTALL = "python scripts/install.py"  # torch for this machine's driver, then the project


def memory_line(p, plan: Path) -> str:
    """The profile and the predicted peak of a training step: on the plan's largest
    micro-batch when ``plan`` holds one, else a full ``batching.max_tokens`` micro-batch."""
    from kohakumoss.device import resolve_device
    from kohakumoss.training.autoprofile import resolve_profile

    batch, source = [(p.batching.max_tokens, 0)], f"a full {p.batching.max_tokens}-token micro-batch"
    if (plan / "manifest.json").is_file():
        from kohakumoss.data.planfile import read_plan
        from kohakumoss.training.engines import plan_token_batches

        batches = plan_token_batches(read_plan(plan)[0])
        if batches:
            batch = max(batches, key=lambda b: sum(i + t for i, t in b))
            source = f"the plan's largest micro-batch ({sum(i + t for i, t in batch)} tokens)"
    try:
        _, _, est, why = resolve_profile(p, batch, resolve_device(p.train.device))
    except Exception as e:  # advice only
        return f"no estimate ({type(e).__name__}: {e})"
    return f"{why}; {est.describe()}, for {source}"


def split_line(p, plan: Path) -> str:
    """``parallel.mode: threaded``: which joint blocks go to which device, and each one's
    predicted peak against its free memory (the train stage logs the same)."""
    from kohakumoss.device import resolve_device
    from kohakumoss.parallel.split import split_devices
    from kohakumoss.training.autoprofile import device_split, resolve_profile
    from kohakumoss.training.catalog import typical_batch

    try:
        batch, what = typical_batch(p, plan)
        run = resolve_device(p.train.device)
        devices = split_devices(p.parallel.devices, run)
        engines = resolve_profile(p, batch, run, devices=devices).engines
        split = device_split(p, batch, engines, devices)
    except Exception as e:  # advice only
        return f"no split ({type(e).__name__}: {e})"
    return f"{split.describe()}, for {what}" + ("" if split.fits else
                                                 ": a device's share is more than it has")


def catalog_lines(out, p, plan: Path, shown: int = 5) -> None:
    """The catalog's fastest rows that fit this machine's first card (or, without one, all
    of them) and its available RAM: ``kmoss profiles`` for the rest."""
    import torch

    from kohakumoss.training.autoprofile import free_memory
    from kohakumoss.training.catalog import catalog, fitting, typical_batch
    from stages.profiles import catalog_table

    try:
        batch, what = typical_batch(p, plan)
        rows = catalog(p, batch)
    except Exception as e:  # advice only
        out.print(f"memory catalog: no estimate ({type(e).__name__}: {e})")
        return
    vram = torch.cuda.mem_get_info(0)[1] / 2**30 if torch.cuda.is_available() else None
    ram = free_memory(torch.device("cpu")) / 2**30
    fit = fitting(rows, vram, ram)
    where = (f"this card's {vram:.1f} GiB and " if vram else "") + f"{ram:.1f} GiB of free RAM"
    out.print(catalog_table(fit[:shown], f"the fastest of {len(fit)} of {len(rows)} memory "
                                         f"combinations that fit {where}, for {what} "
                                         f"(kmoss profiles lists them all)"))


def main(params: Path = typer.Option(Path("params.yaml"), "--params", "-p",
                                     help="The params file whose model paths are checked."),
         plan: Path = typer.Option(Path("artifacts/plan"), help="The plan whose largest "
                                   "micro-batch the memory estimate uses (if it is there).")
         ) -> None:
    """Print versions, devices (and their bf16 support and free memory), whether the
    weights and datasets named in params.yaml can be found, and the memory profile with its
    predicted peak. Exit code 1 if something the params need is missing."""
    import torch
    from rich.markup import escape

    out = wide_console()
    t = Table(title="kohakumoss doctor", show_header=False)
    t.add_row("python", platform.python_version())
    for name in (*PACKAGES, *KERNEL_PACKAGES):
        try:
            t.add_row(name, md.version(name))
        except md.PackageNotFoundError:
            t.add_row(name, escape(f"not installed (optional: {KERNEL_PACKAGES[name]})")
                      if name in KERNEL_PACKAGES else
                      f"[red]not installed[/]: fix: {escape(INSTALL)} (or pip install -e .)")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            t.add_row(f"cuda:{i}", f"{torch.cuda.get_device_name(i)}, bf16 "
                      f"{'yes' if torch.cuda.is_bf16_supported() else 'no'}, "
                      f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
    elif shutil.which("nvidia-smi"):  # a card and its driver, but torch is a CPU build
        t.add_row("cuda", f"[red]an NVIDIA driver is here but torch {escape(torch.__version__)} sees "
                          f"no CUDA device[/]: fix: {escape(INSTALL)} (the torch build of this "
                          f"driver)")
    else:
        t.add_row("cuda", "no CUDA device (CPU only: the tiny default runs, real weights need a GPU)")

    from kohakumoss.checks.params import weight_problems
    from kohakumoss.errors import KohakuError
    from kohakumoss.params import read_params

    problems, p = 0, None
    if not params.is_file():
        t.add_row("params", f"[yellow]{params} not found[/]")
    else:
        try:
            p = read_params(params)
        except KohakuError as e:  # what every stage would refuse: said in the table, not a traceback
            problems += 1
            t.add_row("params", f"[red]{escape(str(e))}[/]")
    if p is not None:
        for key, problem in weight_problems(p).items():
            section, _, name = key.partition(".")
            value = getattr(getattr(p, section), name)
            problems += problem is not None
            shown = (value or "(none)") if problem is None else \
                f"[red]{escape(problem)}[/]: fix: kmoss config --weights FOLDER --force"
            t.add_row(key, shown)
        for i, d in enumerate(p.data.datasets):
            where = str(getattr(d.args, "path", ""))
            ok = "*" in where or Path(where).exists()
            problems += not ok
            t.add_row(f"dataset {i} ({d.source})", where if ok else
                      f"[red]{escape(where)}: not found[/]: fix: kmoss config --data FOLDER --force")
        if p.parallel.world_size > 1:
            from kohakumoss.device import resolve_device
            from kohakumoss.parallel import device_problem

            kind = resolve_device(p.train.device).type
            problem = device_problem(p, kind)
            problems += problem is not None
            t.add_row("parallel", f"[red]{escape(problem)}[/]" if problem else
                      f"{p.parallel.world_size} ranks on {p.parallel.nodes} node(s), {kind}, "
                      f"launched by kmoss train through torchrun")
        if not any(v is not None for v in weight_problems(p).values()):
            t.add_row("memory", escape(memory_line(p, plan)))
            if p.parallel.mode == "threaded":
                t.add_row("split", escape(split_line(p, plan)))
    out.print(t)
    if p is not None and not any(v is not None for v in weight_problems(p).values()):
        catalog_lines(out, p, plan)
    if problems:
        raise typer.Exit(1)
