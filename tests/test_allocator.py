"""The allocator's settings for tight profiles: expandable segments where weights stream or
activations go to the host, on CUDA only, and never over the user's PYTORCH_CUDA_ALLOC_CONF."""

from __future__ import annotations

import pytest
import torch

from kohakumoss.memory import allocator
from kohakumoss.memory.profiles import PROFILE_ENGINES


@pytest.fixture
def settings(monkeypatch):
    made = []
    monkeypatch.setattr(allocator, "apply_setting", made.append)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    return made


@pytest.mark.parametrize("profile,expected", [("speed", False), ("balanced", False),
                                              ("low", True), ("minimal", True)])
def test_streamed_and_offloaded_profiles_take_expandable_segments(settings, profile, expected):
    assert allocator.tight_allocator(PROFILE_ENGINES[profile], torch.device("cuda")) is expected
    assert settings == ([allocator.SETTING] if expected else [])


def test_the_cpu_and_the_users_own_setting_are_left_alone(settings, monkeypatch, caplog):
    assert not allocator.tight_allocator(PROFILE_ENGINES["minimal"], torch.device("cpu"))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:native")
    with caplog.at_level("INFO"):
        assert not allocator.tight_allocator(PROFILE_ENGINES["minimal"], torch.device("cuda"))
    assert settings == []
    assert "PYTORCH_CUDA_ALLOC_CONF=backend:native as set" in caplog.text


@pytest.mark.gpu
def test_on_cuda_new_segments_are_expandable(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run through the device machine)")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert allocator.tight_allocator(PROFILE_ENGINES["minimal"], torch.device("cuda"))
    try:
        torch.cuda.empty_cache()  # a block freed by an earlier test would sit in an old segment
        x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
        segments = [s for s in torch.cuda.memory_snapshot() if s["address"] <= x.data_ptr()
                    < s["address"] + s["total_size"]]
        assert segments and segments[0]["is_expandable"]
    finally:
        allocator.apply_setting("expandable_segments:False")
