"""An exponential moving average of the trainable weights, kept in fp32.

Update number n (n = 0 for the first) does

    d_n    = min(decay, (1 + n) / (10 + n))      # warmup; ``warmup=False``: d_n = decay
    shadow = d_n * shadow + (1 - d_n) * param

The warmup (TensorFlow's ``ExponentialMovingAverage`` with ``num_updates``) keeps the
average from being dominated by the initial weights early on: the first update keeps
only 10 % of the start, and d_n reaches ``decay`` after ``(10 decay - 1) / (1 - decay)``
updates (80 for 0.9, 890 for 0.99, ~990k for 0.9999); until then the average spans
roughly the last n / 9 updates.

``swap()`` puts the averaged weights into the live parameters for evaluation or export
and restores the live ones exactly on exit; ``copy_to`` writes them into another copy of
the model (matched by name).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

NamedParams = Sequence[tuple[str, nn.Parameter]]


class EMA:
    """fp32 shadows of ``named_params`` (on ``device``, default each parameter's own)."""

    def __init__(self, named_params: NamedParams, decay: float, *, warmup: bool = True,
                 device: torch.device | str | None = None):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}; optim.ema = 0 turns "
                             f"the EMA off (build none)")
        self.decay, self.warmup, self.num_updates = float(decay), warmup, 0
        self.names = [n for n, _ in named_params]
        if len(set(self.names)) != len(self.names):
            raise ValueError("EMA parameter names must be unique")
        self.params = [p for _, p in named_params]
        with torch.no_grad():
            self.shadow = {n: p.detach().to(device or p.device, torch.float32, copy=True)
                           for n, p in named_params}

    def current_decay(self) -> float:
        """The decay the next ``update`` uses."""
        n = self.num_updates
        return min(self.decay, (1 + n) / (10 + n)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self) -> None:
        d = self.current_decay()
        for name, p in zip(self.names, self.params):
            s = self.shadow[name]
            s.mul_(d).add_(p.detach().to(s.device, torch.float32), alpha=1.0 - d)
        self.num_updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "warmup": self.warmup, "num_updates": self.num_updates,
                "shadow": dict(self.shadow)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores shadows and the update count; the configured ``decay`` is kept."""
        shadow = state["shadow"]
        missing = [n for n in self.names if n not in shadow]
        extra = [n for n in shadow if n not in self.shadow]
        if missing or extra:
            raise ValueError(f"EMA state does not match the trainable parameters: missing "
                             f"{missing[:5]}, unexpected {extra[:5]}; resume with the same "
                             f"adapter / trainable set")
        for name, s in self.shadow.items():
            if shadow[name].shape != s.shape:
                raise ValueError(f"EMA state for {name!r} has shape {tuple(shadow[name].shape)}, "
                                 f"the parameter has {tuple(s.shape)}")
            if type(s) is torch.Tensor:
                s.copy_(shadow[name])
            else:  # a sharded full finetune's: this rank's shard of the whole average
                from kohakumoss.parallel.fsdp import shard_like

                s.copy_(shard_like(shadow[name], s))
        self.num_updates = int(state["num_updates"])

    @torch.no_grad()
    def copy_to(self, named_params: NamedParams | None = None) -> None:
        """Write the averages into ``named_params`` (default: the tracked parameters), cast
        to each one's dtype. Names without a shadow are left alone; every shadow must find
        its parameter."""
        targets = list(zip(self.names, self.params)) if named_params is None else named_params
        found = set()
        for name, p in targets:
            if name in self.shadow:
                p.copy_(self.shadow[name])
                found.add(name)
        lost = [n for n in self.names if n not in found]
        if lost:
            raise ValueError(f"copy_to found no parameter for EMA weights {lost[:5]}; pass the "
                             f"same names the EMA was built with")

    @contextlib.contextmanager
    def swap(self) -> Iterator[None]:
        """Evaluate with the averaged weights: live values are backed up (one copy, on their
        own device), the averages copied in, and the live values restored bit-exactly."""
        with torch.no_grad():
            backup = [p.detach().clone() for p in self.params]
            self.copy_to()
        try:
            yield
        finally:
            with torch.no_grad():
                for p, b in zip(self.params, backup):
                    p.copy_(b)
