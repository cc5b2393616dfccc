"""Adapters on the MOSS-Image DiT, built from LyCORIS (``docs/training.md``, ``docs/formats.md``).

``presets`` (which layers), ``options`` (which algorithm takes which options), ``inject``
(``apply_adapters`` -> ``AdapterSet`` for training), ``runtime`` (how one LyCORIS module runs
and merges; ``Attached`` handles), ``norms`` (trained norm deltas) and ``sets`` (modules from
tensor sets, for inference). Files are read and written by ``kohakumoss.formats``
(``load_adapter_file`` is in ``formats.comfy``).

``presets`` and ``options`` are pure config; the names from ``inject`` and ``runtime``
(torch, LyCORIS) load on first use, so checking params imports neither.
"""

from kohakumoss.adapters.presets import (BASES, MODIFIERS, preset_patterns, resolve_norm_targets,
                                         resolve_targets, targeted_modules, targeted_paths)

_LAZY = {"AdapterSet": "inject", "apply_adapters": "inject", "lora_name": "inject",
         "step_seed": "inject", "Attached": "runtime", "merged_weight": "runtime"}

__all__ = ["AdapterSet", "Attached", "BASES", "MODIFIERS", "apply_adapters", "lora_name",
           "merged_weight", "preset_patterns", "resolve_norm_targets", "resolve_targets",
           "step_seed", "targeted_modules", "targeted_paths"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"kohakumoss.adapters.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'kohakumoss.adapters' has no attribute {name!r}")
