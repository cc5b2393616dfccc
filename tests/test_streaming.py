"""Weight streaming: a frozen base whose block weights pass through a ring of slots gives the
resident model's outputs and adapter gradients bit for bit, under every checkpointing mode,
keeps no weight in autograd, and holds only ``slots`` blocks on the device."""

from __future__ import annotations

import os

import pytest
import torch

from kohakumoss.adapters import apply_adapters
from kohakumoss.config import AdapterConfig
from kohakumoss.diffusion.sampler import skipping
from kohakumoss.memory import apply_checkpointing, apply_recompute, repeated_blocks
from kohakumoss.memory.offload import apply_activation_offload
from kohakumoss.memory.streaming import apply_weight_streaming, streamed_weights
from kohakumoss.model import FLAVORS, MOSSImageTransformer, build_layout, cast_model


def _model(dtype=torch.float32, algo="lora", mode="none", stream=0, offload=None, resident=0, **adapter):
    """The tiny DiT with a trained-looking adapter; ``mode`` checkpointing, or ``offload``
    (block / sub-block) activation offload; ``stream`` slots (0: resident), the first
    ``resident`` blocks kept out of the ring."""
    torch.manual_seed(0)
    m = MOSSImageTransformer(FLAVORS["tiny"])
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(0, 0.05 if p.ndim == 1 else 0.2).add_(1.0 if "norm" in name else 0.0)
    cast_model(m, dtype)
    apply_recompute(m)
    if offload:
        apply_activation_offload(m, "cpu", halves=offload == "sub-block")
    else:
        apply_checkpointing(m, mode, 1 if mode == "partial" else 0)
    aset = apply_adapters(m, AdapterConfig(**{"algo": algo, "preset": "all", "dim": 4, "alpha": 2.0,
                                              **adapter}), seed=0)
    with torch.no_grad():  # a trained-looking adapter: every factor non-zero
        for p in aset.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    ring = apply_weight_streaming(m, "cpu", stream, resident=resident) if stream else None
    return m, aset, ring


def _step(model, aset, samples=((3, 4), (2, 5))):
    g = torch.Generator().manual_seed(1)
    c = FLAVORS["tiny"]
    layout = build_layout(list(samples), [4, 6][:len(samples)])
    img = torch.randn(layout.n_img, c.latent_channels, generator=g)
    txt = torch.randn(layout.n_txt, c.text_dim, generator=g)
    sigma = torch.rand(len(samples), generator=g)
    for p in aset.trainable_parameters():
        p.grad = None
    out = model(img, txt, sigma, layout)
    out.float().square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in aset.named_trainable()}


def _same(a, b):
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert torch.equal(out_a, out_b)
    assert grads_a.keys() == grads_b.keys()
    bad = {n: f"{(grads_a[n] - grads_b[n]).abs().max().item():.3g} of {grads_a[n].abs().max().item():.3g}"
           for n in grads_a if not torch.equal(grads_a[n], grads_b[n])}
    assert not bad, (len(bad), len(grads_a), list(bad.items())[:4])


@pytest.mark.parametrize("mode", ["none", "block", "sub-block", "selective", "partial"])
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_streaming_keeps_outputs_and_gradients_bit_identical(mode, slots):
    resident = _step(*_model(mode=mode)[:2])
    model, aset, ring = _model(mode=mode, stream=slots)
    _same(_step(model, aset), resident)
    _same(_step(model, aset), resident)  # a second step on the same ring
    assert sum(u is not None for u in ring.unit_in) <= slots
    assert ring.loads > 0


@pytest.mark.parametrize("algo, kw", [("dora", {}), ("loha", {}), ("oft", {}), ("lokr", {"algo_kwargs": {"factor": 4}})])
def test_streaming_works_under_adapters_that_read_the_base_weight(algo, kw):
    resident = _step(*_model(algo=algo, **kw)[:2])
    _same(_step(*_model(algo=algo, stream=2, **kw)[:2]), resident)


def test_streaming_in_bf16_and_without_grad():
    model, aset, _ = _model(torch.bfloat16, stream=2)
    ref, ref_aset, _ = _model(torch.bfloat16)
    _same(_step(model, aset), _step(ref, ref_aset))
    g = torch.Generator().manual_seed(3)
    c = FLAVORS["tiny"]
    layout = build_layout([(2, 2)], [3])
    args = (torch.randn(layout.n_img, c.latent_channels, generator=g),
            torch.randn(layout.n_txt, c.text_dim, generator=g), torch.tensor([0.5]), layout)
    with torch.no_grad():
        assert torch.equal(model(*args), ref(*args))
        assert torch.equal(model(*args, replace=skipping([1])), ref(*args, replace=skipping([1])))


def test_autograd_keeps_no_streamed_weight_and_evicted_blocks_point_at_the_host():
    model, aset, ring = _model(stream=2)
    slot_ptrs = set(ring.slot_by_ptr)
    kept = []

    def pack(t):
        kept.append(t)
        return t

    g = torch.Generator().manual_seed(1)
    c = FLAVORS["tiny"]
    layout = build_layout([(3, 4)], [4])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # outside the ring's hooks
        out = model(torch.randn(layout.n_img, c.latent_channels, generator=g),
                    torch.randn(layout.n_txt, c.text_dim, generator=g), torch.rand(1, generator=g), layout)
    # the ring's own hooks are innermost: what reaches the outer hook is never a slot
    assert not any(t.untyped_storage().data_ptr() in slot_ptrs for t in kept if isinstance(t, torch.Tensor))
    out.square().mean().backward()
    units = streamed_weights(model)
    in_slot = {u for u in ring.unit_in if u is not None}
    for u, unit in enumerate(units):
        for _, _, p in unit:
            on_slot = p.untyped_storage().data_ptr() in slot_ptrs
            assert on_slot == (u in in_slot)
            if not on_slot:
                assert p.untyped_storage().data_ptr() == ring.host[u].untyped_storage().data_ptr()


def test_only_the_frozen_block_matrices_stream():
    model, aset, ring = _model(stream=2)
    names = {n for n, p in model.named_parameters()
             if any(p is q for unit in streamed_weights(model) for _, _, q in unit)}
    blocks = {path for path, _ in repeated_blocks(model)}
    assert names and all(any(n.startswith(b + ".") for b in blocks) for n in names)
    assert all(model.get_parameter(n).dim() == 2 for n in names)
    assert "video_embedder.weight" not in names and not any("norm" in n for n in names)
    assert ring.host_bytes() == sum(h.numel() * h.element_size() for h in ring.host)
    assert ring.resident_bytes() < ring.host_bytes()
    # the state dict still reads every weight, with the resident model's values
    ref = _model()[0].state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("resident", [1, 3, 4])
@pytest.mark.parametrize("offload", [None, "sub-block"])
def test_resident_blocks_stay_out_of_the_ring_and_change_nothing(resident, offload):
    """The first blocks' weights stay where the rest of the model is; the ring streams the
    others, and the step is the resident model's, bit for bit."""
    ref = _step(*_model(offload=offload)[:2])
    model, aset, ring = _model(stream=2, offload=offload, resident=resident)
    for _ in range(2):
        _same(_step(model, aset), ref)
    blocks = [b for _, b in repeated_blocks(model)]
    assert len(ring.units) == len(blocks) - resident
    streamed = {id(p) for unit in ring.units for _, _, p in unit}
    kept = [p for b in blocks[:resident] for p in b.parameters() if p.dim() == 2]
    assert kept and not any(id(p) in streamed for p in kept)
    assert all(any(id(p) in streamed for p in b.parameters()) for b in blocks[resident:])
    assert ring.loads > 0


def test_streaming_refuses_a_full_finetune_and_a_second_ring():
    m = MOSSImageTransformer(FLAVORS["tiny"])
    with pytest.raises(ValueError, match="full finetune"):
        apply_weight_streaming(m, "cpu", 2)
    model, _, _ = _model(stream=2)
    with pytest.raises(ValueError, match="already"):
        apply_weight_streaming(model, "cpu", 2)
    model, _, _ = _model()
    with pytest.raises(ValueError, match=r"resident blocks 5: there are 5 blocks"):
        apply_weight_streaming(model, "cpu", 2, resident=5)


@pytest.mark.gpu
@pytest.mark.parametrize("slots, offload", [(1, False), (2, False), (4, False), (0, "block"), (2, "sub-block"),
                                            (0, "rebuild"), (2, "rebuild"), (0, "rebuild triton"),
                                            (2, "rebuild triton")])
def test_streaming_on_cuda_is_bit_identical_with_copies_on_a_side_stream(slots, offload):
    """Blocks large enough that a copy takes longer than the compute it overlaps: any
    missing ordering (a reader before its copy, a copy over a slot still read) shows."""
    import dataclasses

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kohakumoss.model import FLAVORS

    c = dataclasses.replace(FLAVORS["tiny"], dim=1024, heads=8, ffn_dim=4096, depth=6, text_blocks=2)
    results = []
    # the fused attention backwards accumulate with atomics (run-to-run different sums): the
    # math backend and deterministic kernels make two resident runs agree bit for bit first
    with sdpa_kernel([SDPBackend.MATH]), _deterministic():
        plain = "triton" if "triton" in str(offload) else False
        for stream, off in ((0, plain), (0, plain), (slots, offload)):
            results.append(_cuda_run(c, stream, off))
    for a, b in zip(results[0], results[1]):
        _same(a, b)
    for a, b in zip(results[0], results[2]):
        _same(a, b)


def _deterministic():
    import contextlib

    @contextlib.contextmanager
    def ctx():
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(before)
    return ctx()


@pytest.mark.gpu
def test_streaming_from_a_node_copy_on_cuda():
    """The node's shared host copy (``NodeCopies``, one process leading itself): mapped from
    its file, registered page-locked, streamed bit for bit as the process's own copies."""
    import dataclasses

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kohakumoss.memory.host_copies import NodeCopies
    from kohakumoss.model import FLAVORS

    c = dataclasses.replace(FLAVORS["tiny"], dim=1024, heads=8, ffn_dim=4096, depth=6, text_blocks=2)
    # in /dev/shm, as a run keeps them (tmpfs: CUDA registers no mapping of a disk file)
    copies = NodeCopies(f"gpu-test-{os.getpid()}", True, lambda: None, pin=True)
    with sdpa_kernel([SDPBackend.MATH]), _deterministic():
        want = _cuda_run(c, 2)
        got = _cuda_run(c, 2, copies=copies)
    for a, b in zip(want, got):
        _same(a, b)
    assert not os.path.exists(copies.path)  # unlinked once mapped


def _cuda_run(c, stream: int, offload: str | bool = False, preset: str = "all", copies=None,
              attention: str | None = None):
    """Two steps of a bf16 LoRA on a mid-size model on the GPU, streamed through
    ``stream`` slots (0: resident), the blocks' inputs offloaded to the host or not: each
    step's output and adapter gradients. ``offload`` may instead name ``rebuild`` (the
    elementwise outputs rebuilt in backward) and ``triton`` (the Triton kernels);
    ``attention`` a backend of ``varlen_attention`` that runs instead of the reference."""
    from kohakumoss.kernels import KERNELS, build_op_table
    from kohakumoss.memory.offload import apply_activation_offload
    from kohakumoss.memory.rebuild import apply_rebuild
    from kohakumoss.model.ops import REFERENCE

    torch.manual_seed(0)
    m = MOSSImageTransformer(c)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(0, 0.02).add_(1.0 if "norm" in name else 0.0)
    cast_model(m, torch.bfloat16).cuda()
    words = str(offload).split()
    if "triton" in words:
        m.ops = build_op_table(torch.device("cuda"), torch.bfloat16,
                               {op: ["triton"] for op in REFERENCE  # attention's backward sums with atomics
                                if "triton" in KERNELS.names(op) and op != "varlen_attention"})
    if attention:  # the backend itself: a failure fails the run
        m.ops.override("varlen_attention", KERNELS.backend("varlen_attention", attention).fn)
    apply_recompute(m)
    if "rebuild" in words:
        apply_rebuild(m)
    elif offload in ("block", "sub-block"):
        apply_activation_offload(m, "cuda", halves=offload == "sub-block")
    aset = apply_adapters(m, AdapterConfig(algo="lora", preset=preset, dim=8, alpha=8.0), seed=0)
    with torch.no_grad():
        for p in aset.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).cuda() * 0.02)
    if stream:
        ring = apply_weight_streaming(m, "cuda", stream, copies=copies)
        assert copies is None or (ring.copies is copies and ring.host[0].is_pinned())
    g = torch.Generator().manual_seed(1)
    layout = build_layout([(32, 32), (24, 40)], [40, 60]).to("cuda")
    img = torch.randn(layout.n_img, c.latent_channels, generator=g).cuda()
    txt = torch.randn(layout.n_txt, c.text_dim, generator=g).cuda()
    sigma = torch.rand(2, generator=g).cuda()
    outs = []
    for _ in range(2):
        for p in aset.trainable_parameters():
            p.grad = None
        out = m(img, txt, sigma, layout)
        out.float().square().mean().backward()
        outs.append((out.detach(), {n: p.grad.clone() for n, p in aset.named_trainable()}))
    if "rebuild" in words:
        assert m.engines.state("rebuild").rebuilt_bytes > 0
    if stream:
        assert ring.loads >= 2 * (c.depth + c.text_blocks) - 2 * stream
    if offload in ("block", "sub-block"):
        assert len(m.engines.state("activation offload").kept) == (c.depth + c.text_blocks) * (2 if offload == "sub-block" else 1)
    return outs


def test_the_node_copies_without_dev_shm_are_one_shared_memory_block(monkeypatch):
    """Where there is no /dev/shm (KMOSS_PORTABLE, as on Windows) the node's copies are a
    named shared-memory block: the leader's writes are what the other ranks read."""
    from kohakumoss import portable
    from kohakumoss.memory.host_copies import NodeCopies

    monkeypatch.setenv("KMOSS_PORTABLE", "1")  # (also under KMOSS_TEST_NATIVE=1)
    assert portable.shm_root() is None
    name = f"test-{os.getpid()}"
    leader = NodeCopies(name, True, lambda: None, pin=False)
    flats, writes = leader.make([5, 300], torch.float32)
    assert writes and leader.path is None
    follower = NodeCopies(name, False, lambda: None, pin=False)
    theirs, writes_too = follower.make([5, 300], torch.float32)
    assert not writes_too
    flats[0].copy_(torch.arange(5.0))
    flats[1].fill_(2.5)
    assert torch.equal(theirs[0], torch.arange(5.0)) and torch.equal(theirs[1], torch.full((300,), 2.5))
    follower.done()
    leader.done()
    assert leader.host_bytes() >= (5 + 300) * 4
