"""Text token counts for planning: exact from a tokenizer, or the documented estimate.

Exact counts wrap each caption the way the text encoder will (``spec/encoders.md`` 1.4:
the tokenizer's own chat template, one user message, generation prompt, thinking on),
truncated at ``max_text_tokens``. Without a tokenizer the planner uses
``captions.estimate_text_tokens`` (``spec/data.md`` 4.3).
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
        from kohakumoss.encoders.tiny_tokenizer import tiny_tokenizer

        return tiny_tokenizer()
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"caption.tokenizer = {path!r} is not a folder; point it at a tokenizer "
                          f"folder (tokenizer.json + tokenizer_config.json with a chat template, "
                          f"e.g. MOSS-Image's tokenizer/ folder), 'tiny' (the tiny test model's) "
                          f"or '' to estimate")
    return open_tokenizer(folder, ConfigError, "point caption.tokenizer at the pipeline's "
                          "tokenizer/ folder")


def tokenizer_identity(path: str) -> str:
    """Hash of what decides token counts: the tokenizer's vocabulary/merges and its chat
    template (so the plan's key changes when either does, wherever the files live)."""
    from kohakumoss.artifacts import hash_json

    tok = load_tokenizer(path)
    return hash_json({"tokenizer": tok.backend_tokenizer.to_str(), "template": tok.chat_template})


class TokenCounter:
    """Counts the templated token length of captions, memoised per caption string."""

    def __init__(self, path: str, max_tokens: int = 4096):
        self.tokenizer = load_tokenizer(path)
        self.max_tokens = max_tokens
        self._memo: dict[str, int] = {}

    def count_many(self, captions: list[str]) -> list[int]:
        todo = sorted({c for c in captions if c not in self._memo})
        if todo:
            ids = templated_ids(self.tokenizer, todo, self.max_tokens)
            self._memo.update((c, len(i)) for c, i in zip(todo, ids))
        return [self._memo[c] for c in captions]
