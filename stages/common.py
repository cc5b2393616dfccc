"""What every stage shares: the --params option and turning user errors into clean messages."""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from kohakumoss.errors import user_message

PIPE_WIDTH = 200  # columns when not a terminal (DVC logs, CI): rich's 80 cut tables and paths


def wide_console(stderr: bool = False) -> Console:
    """A console as wide as the terminal, or ``PIPE_WIDTH`` columns when the output is not one."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else PIPE_WIDTH)


console = wide_console(stderr=True)

PARAMS_OPTION = typer.Option(Path("params.yaml"), "--params", "-p",
                             help="The params file to read (see README: params.yaml).")


def stage(fn):
    """Run a stage body; a failure the user can fix (a ``KohakuError``, a full disk, a
    permission) prints one clear line and exits with status 2; a bug keeps its traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except Exception as e:
            message = user_message(e)
            if message is None:
                raise
            console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper
