"""Frozen encoders: the Qwen3.5 text encoder (``text.py``) and the FLUX.2 VAE (``vae.py``)."""

from kohakumoss.encoders.text import TextEncoder, TextEncoderError  # noqa: F401
from kohakumoss.tokenizer.tiny import tiny_tokenizer  # noqa: F401
from kohakumoss.encoders.vae import (VAE, VAEError, batch_groups, from_tokens, patchify,  # noqa: F401
                                     to_tokens, unpatchify)
