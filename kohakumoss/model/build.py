"""DiTs built in code: the tiny flavor with fixed random weights, and any size with the
reference's random init (loading weight files lives in ``kohakumoss.formats``)."""

from __future__ import annotations

import torch

from kohakumoss.model.config import FLAVORS, DiTConfig
from kohakumoss.model.dit import MOSSImageTransformer

TINY_SEED = 20261130


def tiny_transformer(seed: int = TINY_SEED) -> MOSSImageTransformer:
    """The tiny flavor with deterministic random weights (linears N(0, 0.02) scaled up for a
    usable signal at width 64, biases 0, norms 1), independent of torch's global RNG."""
    model = MOSSImageTransformer(FLAVORS["tiny"])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2:
                param.copy_(torch.randn(param.shape, generator=g) / param.shape[1] ** 0.5)
            elif name.endswith("norm.weight") or ".norm" in name or "_norm" in name:
                param.fill_(1.0)
            else:
                param.zero_()
    return model


def random_transformer(config: DiTConfig, device: torch.device | str, seed: int = 0,
                       std: float = 0.02, bf16_exact: bool = False) -> MOSSImageTransformer:
    """A model of any size with the reference's random init (linears N(0, std),
    biases 0, norms 1), built on the meta device and materialised on ``device`` (fp32)."""
    with torch.device("meta"):
        model = MOSSImageTransformer(config)
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2:
                param.normal_(0, std, generator=g)
                if bf16_exact:  # so fp32 and bf16 runs share the same weights
                    param.copy_(param.to(torch.bfloat16))
            elif "norm" in name:
                param.fill_(1.0)
            else:
                param.zero_()
    model.rope.reset(device)
    return model
