"""Adapters on the MOSS-Image DiT, built from LyCORIS (``docs/training.md``, ``docs/formats.md``).

``presets`` (which layers), ``inject`` (``apply_adapters`` -> ``AdapterSet`` for training),
``runtime`` (how one LyCORIS module runs and merges; ``Attached`` handles), ``norms``
(trained norm deltas) and ``sets`` (modules from tensor sets, for inference). Files are
read and written by ``kohakumoss.formats`` (``load_adapter_file`` is in ``formats.comfy``).
"""

from kohakumoss.adapters.inject import AdapterSet, apply_adapters, lora_name, step_seed
from kohakumoss.adapters.presets import (BASES, MODIFIERS, preset_patterns, resolve_norm_targets,
                                         resolve_targets, targeted_modules)
from kohakumoss.adapters.runtime import Attached, merged_weight

__all__ = ["AdapterSet", "Attached", "BASES", "MODIFIERS", "apply_adapters", "lora_name",
           "merged_weight", "preset_patterns", "resolve_norm_targets", "resolve_targets",
           "step_seed", "targeted_modules"]
