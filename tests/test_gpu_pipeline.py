"""The tiny pipeline on a CUDA device (marked `gpu`; run on the device machine):
caches encoded on the GPU, a bf16 LoRA trained with previews, exported and sampled."""

from __future__ import annotations

import math

import pytest
import torch

from kohakumoss.params import load_params


class _Recorder:  # stands in for DVCLive where it is not installed
    def __init__(self, *a, **k):
        self.rows = []

    def log(self, step, **values):
        self.rows.append((step, values))

    def image(self, name, image):
        self.rows.append((name, image.size))

    def close(self):
        pass


@pytest.mark.gpu
def test_tiny_pipeline_on_cuda(tmp_path, kohya_dataset, monkeypatch):
    from test_train import _prepare, _write_params

    from kohakumoss.export.formats import load_source, write_export
    from kohakumoss.training import trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "Metrics", _Recorder)
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
