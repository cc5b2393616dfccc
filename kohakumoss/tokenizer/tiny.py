"""A byte-level test tokenizer with the shape of Qwen3.5's chat template, built in code.

Ids 0..255 are the 256 byte values (GPT-2's byte-to-unicode alphabet, no merges), so every
caption tokenises to its UTF-8 bytes and decodes back exactly; ids 256..260 are the special
tokens below. Nothing is normalised. With one user message, the generation prompt and
thinking on, the template renders (``docs/encoders.md#chat-template``)::

    <|im_start|>user\\n{content}<|im_end|>\\n<|im_start|>assistant\\n<think>\\n

and with thinking off the prompt ends ``<think>\\n\\n</think>\\n\\n`` instead. It is what
``TextEncoder.load("tiny")`` and ``TokenCounter("tiny")`` use. Memoised: treat it as
read-only.
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD = "<|endoftext|>"
SPECIALS = (PAD, "<|im_start|>", "<|im_end|>", "<think>", "</think>")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}"
    "{{- '<think>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in character for each byte value 0..255."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)}
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


@lru_cache(maxsize=1)
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {ch: b for b, ch in enumerate(byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=CHAT_TEMPLATE,
                                   pad_token=PAD, eos_token="<|im_end|>")
