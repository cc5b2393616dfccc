"""Text token counts for planning: exact from a tokenizer, or the documented estimate.

Exact counts wrap each caption the way the text encoder will (``docs/encoders.md#chat-template``:
the tokenizer's own chat template, one user message, generation prompt, thinking on),
truncated at ``max_text_tokens``. Without a tokenizer the planner uses
``captions.estimate_text_tokens`` (``docs/data.md#caption-length-estimates``).
"""

from __future__ import annotations

from kohakumoss.tokenizer import load_tokenizer, templated_ids


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
