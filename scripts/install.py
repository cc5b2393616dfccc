#!/usr/bin/env python3
"""Install kohakumoss with the torch build that matches this machine's NVIDIA driver.

Standard library only (it runs before torch is installed). Steps:

1. ``nvidia-smi`` reports the driver's CUDA version and each card's compute capability; no
   ``nvidia-smi`` (or no card) means the CPU build.
2. The torch index: the newest CUDA build the driver runs (``cu130`` for CUDA 13.0+,
   ``cu128`` for 12.8+, ``cu126`` for 12.6+); an older driver is an error naming the fix.
3. ``pip install torch`` from that index, then the project (``-e .``) with its extras:
   ``fa4`` on sm90+ cards (FlashAttention-4), ``eightbit`` (torchao) when asked.
4. ``kmoss doctor``.

``--dry-run`` prints the commands instead of running them.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

INDEX = "https://download.pytorch.org/whl/{}"
BUILDS = ((13, 0, "cu130"), (12, 8, "cu128"), (12, 6, "cu126"))  # newest first
TORCH = "torch>=2.11"
ROOT = Path(__file__).resolve().parent.parent


class InstallError(Exception):
    pass


def driver(smi: str | None = None) -> tuple[tuple[int, int] | None, list[float]]:
    """(the driver's CUDA version, each card's compute capability), or (None, []) without
    ``nvidia-smi`` or a card."""
    smi = smi or shutil.which("nvidia-smi")
    if not smi:
        return None, []
    try:
        head = subprocess.run([smi], capture_output=True, text=True, timeout=30).stdout
        caps = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None, []
    found = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", head)
    cards = [float(c) for c in re.findall(r"^\s*(\d+\.\d+)\s*$", caps, re.M)]
    if not found or not cards:
        return None, []
    return (int(found.group(1)), int(found.group(2))), cards


def torch_index(cuda: tuple[int, int] | None) -> str:
    """The torch wheel index for a driver's CUDA version (None: the CPU build)."""
    if cuda is None:
        return INDEX.format("cpu")
    for major, minor, tag in BUILDS:
        if cuda >= (major, minor):
            return INDEX.format(tag)
    raise InstallError(f"the NVIDIA driver supports CUDA {cuda[0]}.{cuda[1]}; torch's builds need "
                       f"12.6 or newer: update the driver (or install the CPU build with "
                       f"--cpu)")


def commands(cuda: tuple[int, int] | None, cards: list[float], python: str = sys.executable,
             eightbit: bool = False) -> list[list[str]]:
    """The pip commands (torch from its index first, so pip never pulls another build), then
    the doctor."""
    extras = []
    if cuda is not None and cards and max(cards) >= 9.0:  # FlashAttention-4: sm90-sm110
        extras.append("fa4")
    if eightbit:
        extras.append("eightbit")
    project = "." + (f"[{','.join(extras)}]" if extras else "")
    return [[python, "-m", "pip", "install", TORCH, "--index-url", torch_index(cuda)],
            [python, "-m", "pip", "install", "-e", project],
            ["kmoss", "doctor"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--cpu", action="store_true", help="the CPU build, whatever the driver")
    ap.add_argument("--eightbit", action="store_true", help="also torchao (optim.name: adamw8bit)")
    args = ap.parse_args(argv)
    cuda, cards = (None, []) if args.cpu else driver()
    try:
        cmds = commands(cuda, cards, eightbit=args.eightbit)
    except InstallError as e:
        print(f"install: {e}", file=sys.stderr)
        return 2
    where = (f"CUDA {cuda[0]}.{cuda[1]} driver, cards sm{', sm'.join(str(int(c * 10)) for c in cards)}"
             if cuda else "no NVIDIA driver or card: the CPU build")
    print(f"install: {where}")
    for cmd in cmds:
        print("+ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
        if not args.dry_run:
            done = subprocess.run(cmd, cwd=ROOT)
            if done.returncode:
                print(f"install: {cmd[0]} failed (exit {done.returncode})", file=sys.stderr)
                return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
