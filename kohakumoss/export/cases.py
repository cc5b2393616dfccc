"""The adapter cases export fidelity is checked on (``tests/test_export_fidelity.py``) and
measured on (``bench/bench_export_fidelity.py``): every algorithm, and the variants whose
files differ (``docs/exports.md#export-fidelity``), each trained-looking on a small DiT."""

from __future__ import annotations

import torch
from torch import nn

from kohakumoss.adapters import AdapterSet, apply_adapters
from kohakumoss.config import AdapterConfig
from kohakumoss.model.build import tiny_transformer

ALGOS = {"lora": {}, "locon": {}, "loha": {}, "lokr": {"algo_kwargs": {"factor": 4}}, "dora": {},
         "oft": {}, "boft": {"dim": 8}, "glora": {}, "ia3": {}, "dylora": {"dim": 8}, "tlora": {}}
VARIANTS = {
    "lokr-factor-8": ("lokr", {"algo_kwargs": {"factor": 8}}),
    "lokr-full-factors": ("lokr", {"dim": 10000, "alpha": 1.0, "algo_kwargs": {"factor": 4}}),
    "dora-input-axis": ("lora", {"dora": True, "algo_kwargs": {"wd_on_out": False}}),
    "loha-dora": ("loha", {"dora": True}),
    "oft-rescaled": ("oft", {"algo_kwargs": {"rescaled": True}}),
    "boft-rescaled": ("boft", {"dim": 8, "algo_kwargs": {"rescaled": True, "constraint": 1e-2}}),
    "lora-norms": ("lora", {"train_norms": True}),
    "tlora-norms": ("tlora", {"train_norms": True}),
}
CASES = {**{a: (a, kw) for a, kw in ALGOS.items()}, **VARIANTS}  # name -> (algo, adapter knobs)


def trained_case(algo: str, kw: dict, model: nn.Module | None = None, noise: float = 0.05,
                 biases: bool = True, dim: int = 4, alpha: float = 2.0, preset: str = "all"
                 ) -> tuple[nn.Module, AdapterSet]:
    """A float32 DiT (the tiny one unless given; ``biases``: non-zero biases, so bias deltas
    show) with the adapter on ``preset``, every factor moved off its init by ``noise``
    (scales by ``1 + 2 noise``), in eval mode."""
    model = model if model is not None else tiny_transformer().float().eval()
    if biases:
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
    cfg = AdapterConfig(**{"algo": algo, "preset": preset, "dim": dim, "alpha": alpha, **kw})
    aset = apply_adapters(model, cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for lyco in aset.modules.values():
            for name, p in lyco.named_parameters():
                z = torch.randn(p.shape, generator=g, dtype=p.dtype)
                if "dora_scale" in name or "rescale" in name:
                    p.mul_(1 + 2 * noise * z)
                elif name == "scalar":
                    p.copy_(1 + 2 * noise * z)
                else:
                    p.add_(noise * z)
        for n in aset.norms.values():
            n.w_norm.add_(noise * torch.randn(n.w_norm.shape, generator=g))
    return model, aset.eval()
