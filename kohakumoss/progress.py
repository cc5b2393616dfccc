"""Progress of the long stages: a tqdm bar (rate, ETA) in a terminal; one line per interval
otherwise (DVC's logs, CI, a redirected run), with the same rate, ETA and values.

``progress(total, desc, unit)`` returns either; both take ``update(n)``, ``set_postfix(**kv)``
and ``close()`` and work as context managers. ``KMOSS_PROGRESS_SECONDS`` sets the line
interval (default 30 s; 0: a line at every update). The first and last updates always
print a line.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

from tqdm.auto import tqdm

INTERVAL_ENV = "KMOSS_PROGRESS_SECONDS"
DEFAULT_INTERVAL = 30.0


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class LineProgress:
    """tqdm's interface as one plain line per interval (see the module)."""

    def __init__(self, total: int | None, desc: str, unit: str, initial: int = 0,
                 interval: float | None = None, stream: TextIO | None = None):
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.start_n = initial
        self.interval = float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL)) if interval is None else interval
        self.stream = stream
        self.postfix: dict[str, Any] = {}
        self.t0 = self.last = time.monotonic()
        self.printed_n: int | None = None

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **kv: Any) -> None:
        self.postfix = {**(ordered_dict or {}), **kv}

    def line(self) -> str:
        elapsed = time.monotonic() - self.t0
        done = self.n - self.start_n
        rate = done / elapsed if elapsed > 0 and done > 0 else 0.0
        where = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        speed = f", {rate:.2f} {self.unit}/s" if rate else ""
        eta = ""
        if self.total and rate and self.n < self.total:
            eta = f", ETA {_clock((self.total - self.n) / rate)}"
        values = "".join(f", {k}={v}" for k, v in self.postfix.items())
        return f"{self.desc}: {where} {self.unit}{pct}{speed}, elapsed {_clock(elapsed)}{eta}{values}"

    def _print(self) -> None:
        print(self.line(), file=self.stream or sys.stderr, flush=True)
        self.last, self.printed_n = time.monotonic(), self.n

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        first = self.printed_n is None
        finished = self.total is not None and self.n >= self.total
        if first or finished or now - self.last >= self.interval:
            self._print()

    def close(self) -> None:
        if self.printed_n != self.n and self.n != self.start_n:
            self._print()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(total: int | None, desc: str, unit: str, *, initial: int = 0, enabled: bool = True,
             leave: bool = True, interval: float | None = None, stream: TextIO | None = None):
    """A bar in a terminal, lines otherwise, nothing when not ``enabled``."""
    out = stream or sys.stderr
    if not enabled:
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=True)
    if out.isatty():
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, leave=leave, file=out)
    return LineProgress(total, desc, unit, initial, interval, stream)
