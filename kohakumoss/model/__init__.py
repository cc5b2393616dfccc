"""The MOSS-Image diffusion transformer: single-device math over explicit packed tensors.

``config`` (flavors, inference from shapes), ``layout`` (the packed varlen layout built on
the host), ``ops`` (the op table every forward goes through), ``dit`` (the modules, named
exactly as the official state-dict keys) and ``checkpoints`` (file formats).
"""

from kohakumoss.model.config import FLAVORS, DiTConfig, flavor, infer_config
from kohakumoss.model.dit import MOSSImageTransformer, cast_model
from kohakumoss.model.layout import PackedLayout, build_layout

__all__ = ["FLAVORS", "DiTConfig", "MOSSImageTransformer", "PackedLayout", "build_layout",
           "cast_model", "flavor", "infer_config"]
