"""`kmoss train`: train the adapter (or the full model) on the planned, cached batches."""

from __future__ import annotations

import subprocess
from pathlib import Path

import typer

from stages.common import PARAMS_OPTION, console, stage


@stage
def main(
    params: Path = PARAMS_OPTION,
    plan: Path = typer.Option(Path("artifacts/plan"), help="The plan directory."),
    catalog: Path = typer.Option(Path("artifacts/catalog"), help="The scan's catalog directory."),
    text_cache: Path = typer.Option(Path("artifacts/cache/text"), help="Text cache directory."),
    latent_cache: Path = typer.Option(Path("artifacts/cache/latents"), help="Latent cache directory."),
    kernels: Path = typer.Option(Path("artifacts/kernels"), help="Kernel tuning table directory "
                                 "(kmoss tune_kernels)."),
    runs: Path = typer.Option(Path("runs"), help="Runs folder; this run writes runs/<run.name>/."),
) -> None:
    """Train on the plan's batches in order: latents and text from the caches, the MOSS
    rectified-flow objective, checkpoints every train.checkpoint_every steps.

    A killed run resumes from its newest good checkpoint when started again (a checkpoint
    made against another plan or other training params is refused). Metrics and plots go to
    runs/<name>/dvclive (dvc exp show, dvc plots show); they are rebuilt from the
    checkpoints on every start, so a finished run started again only rebuilds them.
    The op table follows the kernel tuning table when it matches this device (shapes it
    lacks are measured first, within kernels.retune_seconds).
    """
    from kohakumoss.device import resolve_device
    from kohakumoss.parallel import init_distributed, launch_command, shutdown, under_launcher
    from kohakumoss.params import load_params
    from kohakumoss.training.build import RunPaths, build_components
    from kohakumoss.training.trainer import Trainer

    p = load_params(params)
    device = resolve_device(p.train.device)
    if p.parallel.world_size > 1 and not under_launcher():
        # the ranks are processes of their own: torchrun starts them, each runs this command
        args = ["--params", str(params), "--plan", str(plan), "--catalog", str(catalog),
                "--text-cache", str(text_cache), "--latent-cache", str(latent_cache),
                "--kernels", str(kernels), "--runs", str(runs)]
        cmd = launch_command(p, args, device.type)
        console.print(f"parallel.world_size {p.parallel.world_size}: {' '.join(cmd[1:])}", highlight=False)
        code = subprocess.run(cmd).returncode
        if code:
            console.print(f"[bold red]error:[/] a rank failed (exit {code}); run kmoss train again "
                          f"to resume from the newest checkpoint", highlight=False)
        raise typer.Exit(code)
    dist = init_distributed(p, device.type)
    paths = RunPaths(plan, catalog, text_cache, latent_cache, runs / p.run.name, kernels)
    try:
        result = Trainer(p, paths, build_components(p, paths, dist=dist)).run()
    finally:
        shutdown(dist)
    if not dist.main:
        return
    if not result.losses:
        console.print(f"the run is complete at step {result.end_step}; its metrics and summary were "
                      f"rebuilt from {result.checkpoint}")
        return
    console.print(f"trained steps {result.start_step}..{result.end_step} "
                  f"(loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}"
                  + (f", {len(result.skipped_steps)} skipped" if result.skipped_steps else "")
                  + f"); checkpoint {result.checkpoint}")

if __name__ == "__main__":
    typer.run(main)
