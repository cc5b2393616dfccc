"""The MOSS-Image diffusion transformer: single-device math over explicit packed tensors.

``config`` (flavors, inference from shapes), ``layout`` (the packed varlen layout built on
the host), ``ops`` (the op table every forward goes through: ``OpEntry``, ``OpTable``, the
references of the DiT's math), ``engines`` (the contract engines act
through: ``Handle``, ``EngineRegistry``), ``dit`` (the modules, named exactly as the
official state-dict keys), ``build`` (tiny and random models) and ``flops`` (the step's
model FLOPs). File formats live in ``kohakumoss.formats``.

The package's names load on first use: ``kohakumoss.model.config`` alone (the shapes and
module paths ``kmoss scan`` checks params against) imports no torch.
"""

from kohakumoss.model.config import FLAVORS, DiTConfig, flavor, infer_config

_LAZY = {"MOSSImageTransformer": "dit", "cast_model": "dit", "PackedLayout": "layout",
         "build_layout": "layout"}

__all__ = ["FLAVORS", "DiTConfig", "MOSSImageTransformer", "PackedLayout", "build_layout",
           "cast_model", "flavor", "infer_config"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"kohakumoss.model.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'kohakumoss.model' has no attribute {name!r}")
