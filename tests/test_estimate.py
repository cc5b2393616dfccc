"""The memory estimator and profile resolution (``kohakumoss/training/estimate.py``): what it
counts is what a real forward keeps, the checkpointing modes order as they should, the
parameter accounting of adapter and full runs, and ``profile: auto``'s choice."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kohakumoss.memory.profiles import PROFILE_ENGINES, MemoryEngines
from kohakumoss.model import FLAVORS, build_layout
from kohakumoss.model.engines import Handle
from kohakumoss.training import autoprofile as A
from kohakumoss.training import estimate as E

from conftest import make_params

DS = [{"source": "kohya", "path": "unused"}]
BATCH = [(12, 4), (10, 6)]  # two samples: (image tokens, text tokens)


def _lora(**extra):
    return make_params(DS, adapter={"algo": "lora", "dim": 4, "alpha": 4.0}, train={"dtype": "fp32"},
                       **extra)


def test_auto_drops_the_kept_fp8_transposes_before_checkpointing():
    """With ``precision.fp8_compute: full``, speed keeps the codes' transposes (counted: their
    bytes again); where they alone do not fit, auto runs speed without them rather than
    recompute anything."""
    p = make_params(DS, adapter={"algo": "lora", "dim": 4, "alpha": 4.0}, train={"dtype": "bf16"},
                    precision={"base": "fp8", "fp8_compute": "full"})
    cpu = torch.device("cpu")
    made = dataclasses.replace(PROFILE_ENGINES["speed"], fp8_transposes=False)
    kept_peak, made_peak = (E.estimate(p, BATCH, e).peak for e in (PROFILE_ENGINES["speed"], made))
    assert kept_peak > made_peak
    assert A.slowdown(PROFILE_ENGINES["speed"], 2) < A.slowdown(made, 2) < A.slowdown(PROFILE_ENGINES["balanced"], 2)
    name, engines, _, _ = A.resolve_profile(p, BATCH, cpu, free=int(kept_peak / A.HEADROOM) + 1)
    assert (name, engines) == ("speed", PROFILE_ENGINES["speed"])
    name, engines, est, why = A.resolve_profile(p, BATCH, cpu, free=int((kept_peak + made_peak) / 2 / A.HEADROOM))
    assert engines == made and est.peak == made_peak and "fits" in why
    plain = _lora()  # no fp8 compute: speed with nothing to keep (the log does not say it)
    assert A.resolve_profile(plain, BATCH, cpu, free=10**12)[1] == MemoryEngines("none")
    assert "fp8 transposes kept" in PROFILE_ENGINES["speed"].describe()
    assert "fp8" not in MemoryEngines("none").describe()


def test_the_estimate_counts_what_a_real_forward_keeps():
    """The meta-device count of the kept activations matches what a CPU forward of the same
    model (same engines, same adapter, attention kept as the fused kernels keep it) saves
    for backward in its blocks: within 3% (the first block's input carries no gradient in a
    real adapter run, which the estimate, counting every block alike, does not model)."""
    p = _lora()
    engines = MemoryEngines("none")
    est = E.estimate(p, BATCH, engines)
    cpu, _, _, trained = E._meta_model(p, engines, device="cpu")  # the same model, with storage
    adapter = [t for _, t in trained]
    c = cpu.config
    layout = build_layout([(3, 4), (2, 5)], [4, 6])
    saved: dict[int, int] = {}
    params = {t.untyped_storage()._cdata for t in [*cpu.parameters(), *cpu.buffers(), *adapter]}

    def pack(t):
        s = t.untyped_storage()
        if s._cdata not in params:
            saved[s._cdata] = s.nbytes()
        return t

    blocks = set()
    counting = cpu.engines.register(Handle("counting"))
    for block in [*cpu.text_embedder.blocks, *cpu.layers]:
        def counted(forward):
            def run(*args, **kwargs):
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    return forward(*args, **kwargs)
            return run

        cpu.engines.wrap_part(counting, block, "forward", counted)
        blocks.add(block)
    g = torch.Generator().manual_seed(0)
    cpu(torch.randn(layout.n_img, c.latent_channels, generator=g),
        torch.randn(layout.n_txt, c.text_dim, generator=g), torch.rand(2, generator=g), layout)
    # the estimate adds the step's own tensors (latents, noise, target, prediction, text)
    own = layout.n_img * c.latent_channels * 16 + layout.n_txt * c.text_dim * 4
    real = sum(saved.values())
    assert abs(est.activations - own - real) <= 0.03 * real, (est.activations - own, real)


def test_the_modes_order_and_partial_steps_between_none_and_block():
    """At the published size and four 1 MP samples: block < sub-block < selective < none,
    and partial steps down from none one block at a time to ``block`` (k = depth). The last
    step is the largest: a block's backward on top of its recomputation needs less than on
    top of what it kept (``RECOMPUTED_WORKING_SET`` against ``WORKING_SET``, as measured)."""
    p = make_params(DS, adapter={"algo": "lora", "dim": 32, "alpha": 32.0}, train={"dtype": "bf16"})
    batch = [(4096, 104)] * 4
    built = E._meta_model(p, MemoryEngines(), FLAVORS["base"])
    peak = {m: E.estimate(p, batch, MemoryEngines(m), _model=built).peak
            for m in ("none", "block", "sub-block", "selective")}
    assert peak["block"] < peak["sub-block"] < peak["selective"] < peak["none"], peak
    depth = FLAVORS["base"].depth
    partial = [E.estimate(p, batch, MemoryEngines("partial", k), _model=built).peak for k in range(1, depth + 1)]
    assert peak["none"] > partial[0] and all(a > b for a, b in zip(partial[:-1], partial[1:-1]))
    assert partial[-1] == peak["block"]
    assert peak["block"] < partial[-2]
    assert partial[-2] - peak["block"] > max(a - b for a, b in zip(partial[:-2], partial[1:-1]))
    est = E.estimate(p, batch, MemoryEngines("none"), _model=built)
    assert "predicted peak" in est.describe() and est.tokens == 4 * 4200


def test_parameter_accounting_of_adapter_and_full_runs():
    base = FLAVORS["base"]
    lora = make_params(DS, adapter={"algo": "lora", "dim": 32, "alpha": 32.0}, train={"dtype": "bf16"})
    e = E.estimate(lora, [(4096, 104)], MemoryEngines("block"), config=base)
    n_base = 5_082_308_608
    assert e.weights == pytest.approx(2 * n_base, rel=0.02)  # bf16 base (the modulation fp32)
    trained = 74_317_824  # rank 32 on attention + MLP of the 42 joint blocks
    # AdamW's two fp32 moments, and a step count (one fp32 value) for each of the 504 tensors
    assert (e.trained, e.gradients, e.optimizer) == (4 * trained, 4 * trained, 8 * trained + 4 * 504)
    full = make_params(DS, adapter={"algo": "full"}, train={"dtype": "bf16"})
    f = E.estimate(full, [(4096, 104)], MemoryEngines("block"), config=base)
    # fp32 masters + autocast's bf16 copies, fp32 gradients, AdamW's two fp32 states
    tensors = len(list(E._meta_model(full, MemoryEngines("block"), base)[0].parameters()))
    assert (f.weights, f.trained, f.gradients, f.optimizer) == (6 * n_base, 0, 4 * n_base,
                                                                 8 * n_base + 4 * tensors)


def test_auto_picks_the_fastest_engines_that_fit():
    p = _lora()
    cpu = torch.device("cpu")
    speed = E.estimate(p, BATCH, PROFILE_ENGINES["speed"]).peak
    block = E.estimate(p, BATCH, MemoryEngines("block")).peak
    balanced = E.estimate(p, BATCH, PROFILE_ENGINES["balanced"]).peak
    assert block < balanced < speed  # selective keeps the matmul outputs, block only inputs
    name, engines, est, why = A.resolve_profile(p, BATCH, cpu, free=10 * speed)
    assert (name, engines) == ("speed", MemoryEngines("none")) and "fits" in why
    # the order auto tries: partial of a few blocks is faster than balanced's selective
    # recomputation, partial of many slower
    depth = 2
    assert A.slowdown(MemoryEngines("partial", 1), 42) < A.slowdown(PROFILE_ENGINES["balanced"], 42) \
        < A.slowdown(MemoryEngines("partial", 21), 42) < A.slowdown(MemoryEngines("block"), 42)
    # measured: activation offload's replayed recomputation beats plain block checkpointing,
    # and minimal's halves (two tails skipped per block) beat low's blocks
    assert A.slowdown(MemoryEngines("sub-block", offload=True), depth) \
        < A.slowdown(PROFILE_ENGINES["minimal"], depth) < A.slowdown(PROFILE_ENGINES["low"], depth) \
        < A.slowdown(MemoryEngines("block"), depth)
    # between selective and speed: the fastest that fits, each faster one does not
    for free in (int((balanced + speed) / 2 / A.HEADROOM), int((block + balanced) / 2 / A.HEADROOM)):
        name, engines, est, why = A.resolve_profile(p, BATCH, cpu, free=free)
        assert est.peak <= free * A.HEADROOM
        faster = [MemoryEngines("partial", k) for k in range(1, depth)] + [PROFILE_ENGINES["balanced"]]
        for other in faster:
            if A.slowdown(other, depth) < A.slowdown(engines, depth):
                assert E.estimate(p, BATCH, other).peak > free * A.HEADROOM, other
    assert (name, engines) == ("auto", MemoryEngines("block")) or engines.checkpointing == "partial"
    name, engines, est, why = A.resolve_profile(p, BATCH, cpu, free=block // 4)
    # the leanest on the CPU: minimal's sub-block checkpointing (streaming, offload and the
    # host update need a CUDA device)
    assert name == "minimal" and engines.checkpointing == "sub-block" and not engines.offload
    assert "nothing fits" in why and "lower batching.max_tokens" in why
    # a named profile is taken as it is
    named = dataclasses.replace(make_params(DS, adapter={"algo": "lora"}), profile="minimal")
    cuda = torch.device("cuda")  # a device name: nothing here touches a GPU
    assert A.resolve_profile(named, BATCH, cuda)[1] == PROFILE_ENGINES["minimal"]
    # on the CPU there is nothing to stream to: minimal runs its checkpointing, and says so
    _, engines, _, why = A.resolve_profile(named, BATCH, cpu)
    assert engines == dataclasses.replace(PROFILE_ENGINES["minimal"], stream_slots=0, optimizer="device",
                                          offload=False)
    assert "weight streaming is off" in why and "CUDA device" in why and "host update is off" in why \
        and "activation offload is off" in why


def test_streaming_profiles_hold_fewer_weights_and_auto_reaches_them_on_cuda():
    """low and minimal keep 4 and 2 blocks of the frozen base on the device; auto takes them
    when resident block checkpointing does not fit (on a CUDA device only)."""
    base = FLAVORS["base"]
    p = dataclasses.replace(make_params(DS, adapter={"algo": "lora", "dim": 32}, train={"dtype": "bf16"}),
                            profile="auto")
    batch = [(4096, 104)]
    engines = {**PROFILE_ENGINES, "block": MemoryEngines("block")}  # block: low, resident
    est = {name: E.estimate(p, batch, engines[name], config=base) for name in ("block", "low", "minimal")}
    # a joint block (q k v o, up-gate, down) and a text block (qkv, proj, gate, up, down) both
    # hold 4 D^2 + 3 D F matrix elements, in bf16
    block_bytes = 2 * (4 * base.dim * base.dim + 3 * base.dim * base.ffn_dim)
    assert est["block"].weights - est["minimal"].weights == pytest.approx(
        (base.depth + base.text_blocks - 2) * block_bytes, rel=0.01)
    assert est["low"].weights - est["minimal"].weights == pytest.approx(2 * block_bytes, rel=0.01)
    # low and minimal offload the blocks' (halves') inputs and attention outputs: the device
    # keeps those of two parts
    assert est["block"].activations > est["low"].activations > est["minimal"].activations
    # the host update: no gradient, optimizer state or EMA on the device, the parameters stay
    assert est["minimal"].gradients == est["minimal"].optimizer == est["low"].optimizer == 0
    assert est["minimal"].trained == est["block"].trained == est["block"].gradients > 0
    # host memory: the streamed copies, then masters, gradients, two AdamW states and the
    # landing buffers (fp32, 5 x 4 bytes per trained number), then the offloaded inputs and
    # attention outputs (one of each per block for low, minimal a second input: its halves')
    trained = est["low"].trained // 4
    streamed = (base.depth + base.text_blocks) * block_bytes
    row = 2 * base.dim  # bf16 bytes of one token at model width
    offloaded = (base.depth * 4200 + base.text_blocks * 104) * row * 2
    assert est["block"].host == 0
    assert est["low"].host == pytest.approx(streamed + 20 * trained + offloaded, rel=0.01)
    assert est["minimal"].host == pytest.approx(est["low"].host + offloaded / 2, rel=0.01)
    cuda = torch.device("cuda")
    free = int((est["low"].peak + est["block"].peak) / 2 / A.HEADROOM)
    name, engines, chosen, why = A.resolve_profile(p, batch, cuda, free=free, config=base,
                                                   host_free=64 * 2**30)
    # as fast as low, leaner; the room left filled with resident blocks, as many as fit
    k = engines.resident_blocks
    assert (name, dataclasses.replace(engines, resident_blocks=0)) == ("minimal", PROFILE_ENGINES["minimal"])
    assert 0 < k < base.depth + base.text_blocks - 1 and f"the first {k} blocks' weights resident" in why
    budget = int(free * A.HEADROOM)
    assert chosen.peak <= budget < E.estimate(p, batch, dataclasses.replace(engines, resident_blocks=k + 1),
                                              config=base).peak
    assert chosen.weights - est["minimal"].weights == pytest.approx(k * block_bytes, rel=0.01)
    assert est["minimal"].host - chosen.host == pytest.approx(k * block_bytes, rel=0.01)
    # with room for every block, all but one stay resident (streaming streams at least one);
    # a full finetune streams every block
    built = E._meta_model(p, PROFILE_ENGINES["speed"], base)
    roomy = A._fill_resident(p, batch, PROFILE_ENGINES["minimal"], est["minimal"], built, 2**50)[0]
    assert roomy.resident_blocks == base.depth + base.text_blocks - 1
    full = dataclasses.replace(p, adapter=dataclasses.replace(p.adapter, algo="full"))
    assert A._fill_resident(full, batch, PROFILE_ENGINES["low"], est["low"], built, 2**50)[0] \
        == PROFILE_ENGINES["low"]
    # a host without the RAM the streamed profiles need: auto does not take them, and a
    # named one is warned about
    name, engines, est, why = A.resolve_profile(p, batch, cuda, free=free, config=base,
                                                host_free=4 * 2**30)
    assert name == "minimal" and "nothing fits" in why and "host memory" in why
    named = dataclasses.replace(p, profile="low")
    why = A.resolve_profile(named, batch, cuda, config=base, host_free=4 * 2**30)[3]
    assert "need 12.7 GiB of host memory and 4.0 GiB is available" in why
    # on the CPU nothing streams: what fits there is only minimal's sub-block checkpointing
    name, engines, _, _ = A.resolve_profile(p, batch, torch.device("cpu"), free=free, config=base)
    assert name in ("auto", "minimal") and not engines.stream_slots and not engines.offload


def test_train_resolves_the_profile_from_the_plan_and_says_why(tmp_path, caplog):
    """``build_components`` (what ``kmoss train`` runs) estimates the plan's largest
    micro-batch, logs the choice and the estimate, and applies the chosen engines; a
    manual profile's engines are applied as set."""
    import logging

    from kohakumoss.params import load_params
    from kohakumoss.training.build import build_components
    from test_train import _prepare, _write_params

    from conftest import make_kohya

    ds = make_kohya(tmp_path / "ds", {"1_a": [(48, 32), (32, 48)]})
    params = _write_params(tmp_path, ds)
    paths = _prepare(tmp_path, params)
    with caplog.at_level(logging.INFO, "kohakumoss.training"):
        c = build_components(load_params(params), paths)
    assert "profile auto: speed is the fastest whose" in caplog.text
    assert "memory: " in caplog.text and "predicted peak" in caplog.text
    assert c.engines.memory == MemoryEngines("none") and not c.applied.checkpointed
    import yaml

    raw = yaml.safe_load(params.read_text())
    raw.update(profile="manual", memory={"checkpointing": "sub-block"})
    params.write_text(yaml.safe_dump(raw))
    c = build_components(load_params(params), paths)
    assert c.engines.memory.checkpointing == "sub-block"
    assert c.applied.checkpointed[:2] == ["text_embedder.blocks.0.attention", "text_embedder.blocks.0.mlp"]


def test_a_streamed_full_finetune_holds_slots_and_the_resident_rest():
    """Streamed, a full finetune's device holds two block slots in bf16 and the rest of the
    model (fp32 masters + autocast copies); gradients and AdamW states live on the host."""
    base = FLAVORS["base"]
    full = make_params(DS, adapter={"algo": "full"}, train={"dtype": "bf16"})
    resident = E.estimate(full, [(4096, 104)], MemoryEngines("block"), config=base)
    streamed = E.estimate(full, [(4096, 104)], MemoryEngines("block", stream_slots=2, optimizer="host"),
                          config=base)
    block = 4 * base.dim * base.dim + 3 * base.dim * base.ffn_dim
    n = resident.gradients // 4  # every parameter
    rest = n - (base.depth + base.text_blocks) * block
    assert streamed.weights == pytest.approx(2 * 2 * block + 6 * rest, rel=0.01)
    assert streamed.gradients == streamed.optimizer == 0
    assert streamed.peak < 24 * 2**30 < resident.peak  # the 24 GB card's full finetune


def test_the_step_in_backward_and_streamed_states_leave_the_device(monkeypatch):
    """``optimizer: fused`` holds one gradient at a time (without accumulation), ``streamed``
    the states of two groups of tensors at a time (``STATE_GROUP_NUMEL`` elements, or the
    widest tensor), the rest in host memory."""
    p = _lora()
    plain = E.estimate(p, BATCH, MemoryEngines("none"))
    fused = E.estimate(p, BATCH, MemoryEngines("none", optimizer="fused"))
    # the tiny adapter's states are one group: all on the device during the step
    assert E.estimate(p, BATCH, MemoryEngines("none", optimizer="streamed")).optimizer == plain.optimizer
    monkeypatch.setattr(E, "STATE_GROUP_NUMEL", 1)  # groups of one tensor each
    streamed = E.estimate(p, BATCH, MemoryEngines("none", optimizer="streamed"))
    widest = max(t.numel() for _, t in E._meta_model(p, MemoryEngines("none"))[3]) * 4
    assert plain.gradients == plain.trained and fused.gradients == widest < plain.gradients
    per_value = plain.optimizer / plain.trained  # states (AdamW's two, the EMA) per fp32 value
    assert per_value >= 2
    assert abs(streamed.optimizer - 2 * widest * per_value) <= 1 and streamed.optimizer < plain.optimizer
    assert streamed.host == plain.host + plain.optimizer and streamed.gradients == plain.gradients
    accumulating = make_params(DS, adapter={"algo": "lora", "dim": 4, "alpha": 4.0},  # held until
                               train={"dtype": "fp32", "grad_accum": 2})  # the last backward
    assert E.estimate(accumulating, BATCH, MemoryEngines("none", optimizer="fused")).gradients == \
        plain.gradients
    cpu = E.placed(MemoryEngines("none", optimizer="streamed"), p, torch.device("cpu"))
    assert cpu[0].optimizer == "device" and "streamed optimizer states are off" in cpu[1]


def test_the_profile_resolves_in_one_place_with_or_without_an_estimate():
    """``resolve_profile`` is where every run's profile resolves (``engine_plan`` and a run
    whose estimate failed included): without a batch nothing is estimated, ``auto`` is
    ``speed`` as placed on the device, a named profile its engines as placed, each with the
    reason a run logs."""
    from kohakumoss.training.engines import engine_plan

    cpu = torch.device("cpu")
    auto = dataclasses.replace(make_params(DS, adapter={"algo": "lora"}), profile="auto")
    got = A.resolve_profile(auto, None, cpu)
    assert got.engines == E.placed(PROFILE_ENGINES["speed"], auto, cpu)[0] and got.estimate is None
    assert got.name == "speed" and "no estimate" in got.why
    assert engine_plan(auto, cpu).memory == got.engines
    low = dataclasses.replace(auto, profile="low")
    got = A.resolve_profile(low, None, cpu)
    assert got.name == "low" and got.engines == E.placed(PROFILE_ENGINES["low"], low, cpu)[0]
    assert "weight streaming is off" in got.why  # the CPU places no ring
    est = A.resolve_profile(low, BATCH, cpu)
    assert est.engines == got.engines and est.estimate.peak > 0
