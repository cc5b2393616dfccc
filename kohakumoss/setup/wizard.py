"""`kmoss config --wizard` (and plain `kmoss config` in a terminal with arguments missing):
ask for the weights, the data, the run's name, the algorithm and the card (offering the
detected one), write the params as `kmoss config` does, then show the memory catalog's
fastest combinations that fit the card with their peaks and, if one is chosen, write it as
a `manual` profile (``docs/config.md#the-wizard``).

``ask(question, default) -> answer`` and ``say(line)`` are the terminal's (typer's prompt
and the console in the command); the command never calls this where stdin is not a
terminal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from kohakumoss.config import ALGOS
from kohakumoss.configlib import ConfigError
from kohakumoss.setup.configure import PRESETS, Report, _dump, _load, card_vram_gib, configure, set_key

Ask = Callable[[str, str], str]
SHOWN = 5  # catalog rows offered


def _card_default(card: Callable[[], float | None]) -> tuple[str, str]:
    gib = card()
    if gib is None:
        return "none", "no CUDA card found"
    fits = [k for k, v in PRESETS.items() if not v.full and v.vram_gib <= gib + 0.5]
    name = max(fits, key=lambda k: PRESETS[k].vram_gib) if fits else "6"
    return name, f"detected {gib:.1f} GiB"


def run_wizard(params: Path, ask: Ask, say: Callable[[str], None], *,
               given: dict[str, str | None] | None = None,
               card: Callable[[], float | None] = card_vram_gib, force: bool = False) -> Report:
    """Ask what ``given`` leaves out, write ``params``, offer the catalog's top rows."""
    given = dict(given or {})
    weights = given.get("weights") or ask(
        "Weights: tiny, a MOSS-Image pipeline folder or a ComfyUI models/ folder", "tiny")
    data = given.get("data") or ask(
        "Your images: a folder, kohya folders, tar shards or a glob, a parquet or jsonl file",
        "examples/dataset")
    name = given.get("name") or ask("The run's name (runs/<name>/)", "default")
    algo = given.get("algo") or ask(f"Algorithm ({' '.join(ALGOS)})", "lora")
    if algo not in ALGOS:
        raise ConfigError(f"algorithm {algo!r}: one of {', '.join(ALGOS)}")
    default, why = _card_default(card)
    choices = [k for k, v in PRESETS.items() if v.full == (algo == "full")] + ["none"]
    vram = given.get("vram") or ask(f"Card: its memory in GiB ({' '.join(choices)}; {why})",
                                    default if default in choices else choices[0])
    if vram not in choices:
        raise ConfigError(f"card {vram!r}: one of {', '.join(choices)}")
    if params.is_file() and not force:
        force = ask(f"{params} exists: replace it (the current one is kept as "
                    f"{params.name}.bak)? y/n", "n").lower().startswith("y")
        if not force:
            raise ConfigError(f"{params} exists and was kept; nothing written")
    report = configure(params, weights=weights, data=data, name=name,
                       algo=algo if algo != "lora" or weights != "tiny" else None,
                       vram=None if vram == "none" else vram, force=force)
    for line in report.lines:
        say(line)
    _offer_catalog(params, None if vram == "none" else PRESETS[vram].vram_gib, ask, say)
    return report


def _offer_catalog(params: Path, vram: float | None, ask: Ask, say: Callable[[str], None]) -> None:
    from kohakumoss.params import load_params
    from kohakumoss.training.catalog import catalog, fitting, typical_batch
    from kohakumoss.training.estimate import size

    p = load_params(params)
    batch, what = typical_batch(p)
    rows = fitting(catalog(p, batch), vram)[:SHOWN]
    if not rows:
        say("no memory combination fits this card at this token budget: lower batching.max_tokens")
        return
    say(f"the fastest memory settings that fit{f' {vram:g} GiB' if vram else ''}, for {what}:")
    for i, r in enumerate(rows, 1):
        label = f"profile {r.name}" if r.name else r.engines.describe() + (
            f", base {r.base}" if r.base != "keep" else "")
        say(f"  {i}. {label}: {size(r.peak)} peak, {size(r.host)} host, "
            f"{r.speed:.3f}x speed's samples/s{'' if r.measured else ' (model)'}")
    pick = ask(f"Use one (1-{len(rows)}; Enter: keep profile {p.profile})", "")
    if not pick:
        return
    if not pick.isdigit() or not 1 <= int(pick) <= len(rows):
        raise ConfigError(f"{pick!r}: a number from 1 to {len(rows)}, or Enter")
    row = rows[int(pick) - 1]
    doc = _load(params)
    if row.name:
        set_key(doc, "profile", row.name)
    else:
        set_key(doc, "profile", "manual")
        e = row.engines
        for key, value in dataclasses.asdict(e).items():
            if key != "resident_blocks":
                set_key(doc, f"memory.{key}", value)
        set_key(doc, "precision.base", row.base)
    text = _dump(doc)
    from kohakumoss.artifacts import atomic_write_text

    atomic_write_text(params, text)
    load_params(params)  # as every stage will read it
    say(f"wrote {params}: profile {row.name or 'manual'}"
        + ("" if row.name else f" ({row.engines.describe()}, base {row.base})"))
