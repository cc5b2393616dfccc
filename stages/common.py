"""What every stage shares: the --params option and turning user errors into clean messages."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import typer
from rich.console import Console

from kohakumoss.artifacts import ArtifactError
from kohakumoss.configlib import ConfigError

console = Console(stderr=True)

PARAMS_OPTION = typer.Option(Path("params.yaml"), "--params", "-p",
                             help="The params file to read (see README: params.yaml).")


def user_errors() -> tuple[type[BaseException], ...]:
    from kohakumoss.data.catalog import CatalogError
    from kohakumoss.data.plan import PlanError
    from kohakumoss.data.scan import ScanError
    from kohakumoss.data.sources import SourceError
    from kohakumoss.cache.store import CacheMiss
    from kohakumoss.export.formats import ExportError
    from kohakumoss.model.checkpoints import CheckpointError

    return (ConfigError, ArtifactError, SourceError, ScanError, CatalogError, PlanError,
            CheckpointError, CacheMiss, ExportError)


def stage(fn):
    """Run a stage body; a user error prints one clear line and exits with status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        try:
            return fn(*args, **kwargs)
        except user_errors() as e:
            console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper
