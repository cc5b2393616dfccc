"""Frozen encoders: the Qwen3.5 text encoder (``text.py``) and the FLUX.2 VAE (``vae.py``).

The package's names load on first use: a stage that reads the caches (``kmoss train`` with
``cache.*: offline``) never imports transformers.
"""

_LAZY = {"TextEncoder": "text", "TextEncoderError": "text_files", "tiny_tokenizer": None,
         "VAE": "vae", "VAEError": "vae", "batch_groups": "vae", "from_tokens": "vae",
         "patchify": "vae", "to_tokens": "vae", "unpatchify": "vae"}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        where = "kohakumoss.tokenizer.tiny" if _LAZY[name] is None else f"kohakumoss.encoders.{_LAZY[name]}"
        return getattr(importlib.import_module(where), name)
    raise AttributeError(f"module 'kohakumoss.encoders' has no attribute {name!r}")
