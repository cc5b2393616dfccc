"""External file formats, one module each, every one both read and written here.

- ``model_files``: the MOSS-Image transformer's official (diffusers) and ComfyUI layouts.
- ``keys``: key rules shared by every format (prefixes, the fused q/k/v rule).
- ``reader``: lazy, verified reads of those files (sharded, prefixed, quantized).
"""

from kohakumoss.formats.model_files import (CheckpointError, load_dit, load_transformer,  # noqa: F401
                                            save_comfy, save_official)
