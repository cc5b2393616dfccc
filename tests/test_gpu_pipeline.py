"""The tiny pipeline on a CUDA device (marked `gpu`; run on the device machine):
caches encoded on the GPU, a bf16 LoRA trained with previews, exported and sampled."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from kohakumoss.params import load_params


class _Live:  # stands in for DVCLive where it is not installed (the GPU machine)
    def __init__(self, *a, **k):
        self.step, self.rows = 0, []

    def log_metric(self, name, value):
        self.rows.append((self.step, name, value))

    def log_image(self, name, path):
        self.rows.append((self.step, name, str(path)))

    def next_step(self):
        self.step += 1

    def end(self):
        pass


@pytest.mark.gpu
def test_tiny_pipeline_on_cuda(tmp_path, kohya_dataset, monkeypatch):
    from test_train import _prepare, _write_params

    from kohakumoss.export.formats import load_source, write_export
    from kohakumoss.training import trainer as trainer_mod

    try:
        import dvclive  # noqa: F401
    except ImportError:
        monkeypatch.setitem(sys.modules, "dvclive", types.SimpleNamespace(Live=_Live))
    params = _write_params(tmp_path, kohya_dataset,
                           encoders={"device": "cuda", "text_dtype": "bf16", "vae_dtype": "bf16"},
                           train={"steps": 6, "checkpoint_every": 3, "dtype": "bf16", "device": "cuda"},
                           preview={"every": 3, "prompts": ["a red circle"], "width": 32, "height": 32,
                                    "steps": 4})
    p = load_params(params)
    paths = _prepare(tmp_path, params)
    trainer = trainer_mod.Trainer(p, paths)
    result = trainer.run(progress=False)
    assert all(math.isfinite(v) for v in result.losses) and result.checkpoint is not None
    assert next(trainer.model.parameters()).is_cuda
    assert torch.cuda.max_memory_allocated() > 0
    src = load_source(p, result.checkpoint)
    out = write_export(src, "comfy", tmp_path / "lora.safetensors")
    assert out.stat().st_size > 0
