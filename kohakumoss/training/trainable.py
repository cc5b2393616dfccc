"""What a run trains, behind one small interface: every weight (full finetune) or an
adapter set. The trainer sees named fp32 parameters, per-parameter lr multipliers
(LoRA+), a per-micro-batch hook for per-step randomness, and a flat state to checkpoint."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from kohakumoss.config import Params
from kohakumoss.model.dit import MOSSImageTransformer


class Trainable(Protocol):
    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]: ...

    def lr_scale(self) -> dict[str, float]: ...

    def prepare_step(self, step: int, micro: int, sigma: torch.Tensor, layout: Any) -> None: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    def describe(self) -> dict[str, Any]: ...

    def to(self, device: torch.device) -> None: ...


class FullFinetune:
    """Every weight of the DiT, held in fp32 (the master copy); compute runs under autocast."""

    def __init__(self, model: MOSSImageTransformer):
        self.model = model
        model.requires_grad_(True)

    def named_parameters(self):
        return list(self.model.named_parameters())

    def lr_scale(self) -> dict[str, float]:
        return {}

    def prepare_step(self, step, micro, sigma, layout) -> None:
        return None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict())

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)

    def describe(self) -> dict[str, Any]:
        return {"algo": "full"}

    def to(self, device: torch.device) -> None:
        if self.model.engines.get("weight streaming") is None:  # a streamed model is placed already
            self.model.to(device)


class AdapterTrainable:
    """A LyCORIS adapter set on a frozen base."""

    def __init__(self, model: MOSSImageTransformer, p: Params):
        from kohakumoss.adapters import apply_adapters

        self.model = model
        model.requires_grad_(False)
        self.adapters = apply_adapters(model, p.adapter, seed=p.run.seed)
        self.cfg = p.adapter

    def named_parameters(self):
        return list(self.adapters.named_trainable())

    def lr_scale(self) -> dict[str, float]:
        return self.adapters.lr_scale()

    def prepare_step(self, step, micro, sigma, layout) -> None:
        self.adapters.prepare_step(step, micro, sigma, layout)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.adapters.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.adapters.load_state_dict(state)

    def to(self, device: torch.device) -> None:
        """The adapter's modules to ``device`` (built beside host weights, see
        ``apply_placement``)."""
        self.adapters.to(device)

    def describe(self) -> dict[str, Any]:
        c = self.cfg
        return {"algo": c.algo, "preset": c.preset, "targets": list(c.targets), "dim": c.dim,
                "alpha": c.alpha, "dora": c.dora, "algo_kwargs": c.algo_kwargs,
                "train_norms": c.train_norms}


def make_trainable(model: MOSSImageTransformer, p: Params) -> Trainable:
    return FullFinetune(model) if p.adapter.full else AdapterTrainable(model, p)
