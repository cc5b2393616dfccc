"""Named points where the fault tests kill a stage (``tests/faults``).

``point("train.checkpoint")`` does nothing unless the environment variable
``KMOSS_KILL_AT`` names that point, as ``name`` or ``name:n`` (the n-th time it is
reached, default the first), optionally ``@r`` for the data-parallel rank ``r`` only
(``train.step:3@1``): then the process sends itself SIGKILL, exactly as a
``kill -9`` or the OOM killer would, at a moment the test chose instead of a moment a
timer happened to hit. Each stage marks an early, a middle and a late point.
"""

from __future__ import annotations

import os
import signal

ENV = "KMOSS_KILL_AT"
_seen: dict[str, int] = {}


def point(name: str) -> None:
    target = os.environ.get(ENV)
    if not target:
        return
    target, _, rank = target.partition("@")
    want, _, nth = target.partition(":")
    if want != name or (rank and rank != os.environ.get("RANK", "0")):
        return
    _seen[name] = _seen.get(name, 0) + 1
    if _seen[name] == int(nth or 1):
        os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))  # (no SIGKILL on Windows)
