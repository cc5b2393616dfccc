"""External file formats, one module each, every one both read and written there
(``docs/formats.md``):

- ``model_files``: the MOSS-Image transformer's official (diffusers) and ComfyUI model files
  (``reader`` finds them and reads them tensor by tensor);
- ``lycoris``: LyCORIS's native adapter file (and the stems and tensor names every
  LyCORIS-family file shares);
- ``comfy``: ComfyUI's adapter file, and ``load_adapter_file`` for any adapter file;
  ``comfy_semantics``: ComfyUI's own reading of one, re-implemented to check our exports;
- ``merged``: a model file with an adapter merged in; ``diffusers``: the transformer folder;
- ``keys``: the key rules they share (prefixes, the fused q/k/v rule);
- ``checkpoint``: a training checkpoint folder (written atomically, verified on every read:
  ``verified``; its nested state as safetensors + JSON, never a pickle: ``statefile``), and
  ``trained``: ``load_trained``, a checkpoint applied to a base model. ``export/``, the
  sampler and the trainer read checkpoints through these alone.
"""

from kohakumoss.formats.model_files import (CheckpointError, dit_shapes, load_dit, load_transformer,  # noqa: F401
                                            save_comfy, save_official)
