"""GPU checks of the DiT (marked `gpu`; run on the device machine)."""

from __future__ import annotations

import pytest
import torch

from kohakumoss.model import FLAVORS, build_layout, cast_model
from kohakumoss.formats.model_files import load_transformer
from kohakumoss.checks.parity import rel_error

from conftest import ROOT

VECTORS = ROOT / "tests" / "data" / "vectors"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2),
                                        (torch.float16, 5e-3)])
def test_vectors_on_cuda(dtype, tol):
    from safetensors.torch import load_file

    b = {k: v.clone() for k, v in load_file(str(VECTORS / "batch.safetensors")).items()}
    torch.backends.cuda.matmul.allow_tf32 = False
    model, _ = load_transformer(VECTORS / "weights_comfy.safetensors", dtype=torch.float32, device="cuda")
    cast_model(model, dtype)
    layout = build_layout(b["hw"].tolist(), b["text_len"].tolist()).to("cuda")
    with torch.no_grad():
        v = model(b["img"].cuda(), b["text"].cuda(), b["sigma"].cuda(), layout)
    assert v.dtype == dtype and rel_error(v, b["v_fp32"]) < tol
    assert FLAVORS["tiny"] == model.config
