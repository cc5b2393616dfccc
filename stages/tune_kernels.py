"""`kmoss tune_kernels`: time every kernel backend on the plan's shapes; keep the fastest for
the run."""

from __future__ import annotations

from pathlib import Path

import typer

from stages.common import PARAMS_OPTION, console, stage


@stage
def main(
    params: Path = PARAMS_OPTION,
    plan: Path = typer.Option(Path("artifacts/plan"), help="The plan directory."),
    out: Path = typer.Option(Path("artifacts/kernels"), help="Tuning table directory (persisted)."),
) -> None:
    """For each op and each problem shape the plan's batches give the transformer (token
    counts bucketed), time forward + backward of every backend that can run on this device
    in the training dtype (the reference, torch.compile, Triton, ...) and record the fastest
    in a table keyed by this device's signature (device, software versions, kernel sources).
    Fastest for the run: a backend whose first call builds something (a compile, a kernel's
    JIT) must save the plan's calls more than that build costs.

    Entries the table already holds for this signature are kept; only new shapes are
    measured, within kernels.tune_seconds. `kmoss train` uses the table when its signature
    matches and says so when it does not. On a CPU it measures the reference against
    torch.compile, so the pipeline is the same everywhere.
    """
    from kohakumoss.device import resolve_device
    from kohakumoss.kernels.backends import missing_kernels
    from kohakumoss.kernels.tuning import summary
    from kohakumoss.params import load_params
    from kohakumoss.training.engines import tune_kernels

    p = load_params(params)
    section, result, manifest = tune_kernels(p, plan, out)
    sig, tuning = section["signature"], section.get("tuning", {})
    console.print(f"kernel table {manifest.content_hash[:12]} for {sig['name']} ({sig['device']} "
                  f"{sig['arch']}, torch {sig['torch']}): {len(section['entries'])} entries; "
                  f"measured {len(result.entries)} now in {result.seconds:.1f} s "
                  f"(budget {p.kernels.tune_seconds:g} s)"
                  + (f", {len(result.untuned)} left untuned (each follows its nearest measured shape until measured)"
                     if result.untuned else ""), highlight=False)
    for row in summary(section):
        console.print(f"  {row['op']}:", highlight=False)
        for s in row["shapes"]:
            speed = f" {s['speedup']:.2f}x over reference" if s["speedup"] else ""
            failed = f" (failed: {', '.join(s['failed'])})" if s["failed"] else ""
            note = f" ({s['note']})" if s["note"] else ""
            console.print(f"    {s['dtype']} {s['shape']}: {s['winner']}{speed}{failed}{note}",
                          highlight=False)
    if "first_run" in tuning:
        console.print(f"first-run tuning time: {tuning['first_run']['seconds']:.1f} s "
                      f"(total {tuning.get('total_seconds', 0):.1f} s)", highlight=False)
    for line in missing_kernels(resolve_device(p.train.device)):
        console.print(f"hint: {line}", highlight=False, markup=False)


if __name__ == "__main__":
    typer.run(main)
