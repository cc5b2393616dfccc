"""The adapters' own op: the LoRA nodes' narrow products (``narrow_mm``), a table of its own
(``ADAPTER_OPS``; each ``AdapterSet`` holds one, ``AdapterSet.ops``), not the DiT's.

A LoRA node makes ``h = x A^T`` and ``t = dy B``: a [tokens, r] result from a whole activation
or gradient, bound by memory. The bf16 node (``adapters/folded.py``) and the fp8 one
(``quant/fp8_compute.py``, through ``fp8_lora_linears``) make both with the set's
``narrow_mm``. Its one way is ``torch.mm`` (the other ways measured, none faster in a step:
``docs/history.md``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def narrow_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` for a tall x [M, K] and a narrow w [K, R]: a LoRA's ``x A^T`` and ``dy B``,
    rounded once to x's dtype."""
    return torch.mm(x, w)


ADAPTER_OPS: dict[str, Callable] = {"narrow_mm": narrow_mm}
