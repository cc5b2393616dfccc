"""The caption as the text encoder reads it, and the tokenizers that count and encode it.

One home below both ``data/`` (exact token counts for planning) and ``encoders/`` (the
text encoder): each caption is wrapped in the tokenizer's own chat template, one user
message, generation prompt, thinking on (``docs/encoders.md``), truncated at the token
limit. ``"tiny"`` names the byte-level test tokenizer of the tiny text encoder.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from kohakumoss.configlib import ConfigError


def chat_messages(caption: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": caption}]


def render_caption(tokenizer, caption: str) -> str:
    """The caption as the text encoder reads it: the tokenizer's own chat template, one user
    message, generation prompt, thinking on."""
    return tokenizer.apply_chat_template(chat_messages(caption), tokenize=False,
                                         add_generation_prompt=True, enable_thinking=True)


def templated_ids(tokenizer, captions: list[str], max_tokens: int) -> list[list[int]]:
    """Token ids of the rendered captions, truncated at ``max_tokens``: what the planner counts
    and the text encoder encodes (one function, so the two cannot disagree)."""
    if not captions:
        return []
    return tokenizer([render_caption(tokenizer, c) for c in captions], add_special_tokens=False,
                     truncation=True, max_length=max_tokens)["input_ids"]


def open_tokenizer(folder: Path, error: type[Exception], fix: str):
    """``AutoTokenizer`` from ``folder``, refusing one without a chat template (``error``,
    with ``fix`` saying what to do)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    if not getattr(tok, "chat_template", None):
        raise error(f"the tokenizer in {folder} has no chat template, and MOSS-Image wraps every "
                    f"caption in one; {fix}")
    return tok


@lru_cache(maxsize=4)
def load_tokenizer(path: str):
    """A Hugging Face tokenizer from a folder (``tokenizer.json`` / ``tokenizer_config.json``),
    or ``"tiny"``: the byte-level test tokenizer of the tiny text encoder."""
    if path == "tiny":
        from kohakumoss.tokenizer.tiny import tiny_tokenizer

        return tiny_tokenizer()
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"caption.tokenizer = {path!r} is not a folder; point it at a tokenizer "
                          f"folder (tokenizer.json + tokenizer_config.json with a chat template, "
                          f"e.g. MOSS-Image's tokenizer/ folder), 'tiny' (the tiny test model's) "
                          f"or '' to estimate")
    return open_tokenizer(folder, ConfigError, "point caption.tokenizer at the pipeline's "
                          "tokenizer/ folder")
