"""Optimiser groups, AdamW / Muon on the tiny DiT, resume equivalence, schedule, clipping, EMA."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from torch import nn

from kohakumoss.config import OptimConfig
from kohakumoss.model import FLAVORS, MOSSImageTransformer, build_layout
from kohakumoss.training.ema import EMA
from kohakumoss.training.optim import (CombinedOptimizer, build_optimizer, build_scheduler,
                                       clip_and_check, lr_lambda, param_groups)


def _cfg(**kw) -> OptimConfig:
    return dataclasses.replace(OptimConfig(), **kw)


def _named(**shapes) -> list[tuple[str, nn.Parameter]]:
    return [(n.replace("__", "."), nn.Parameter(torch.zeros(s))) for n, s in shapes.items()]


def _by_names(groups):
    return {tuple(g["param_names"]): (g["lr"], g["weight_decay"]) for g in groups}


# ---- parameter groups ------------------------------------------------------------------

NAMED = dict(blk__weight=(4, 4), blk__bias=(4,), lyr__dora_scale=(4, 1), lyr__alpha=(),
             lyr__lambda_layer=(2, 2), lyr__rescale=(4, 4), lyr__scalar=(1, 1),
             norm__weight=(4,), up__weight=(4, 2))


def test_moss_rule_exempts_1d_and_named_params():
    groups = param_groups(_named(**NAMED), _cfg(weight_decay=0.1, lr=1e-3))
    assert _by_names(groups) == {
        ("blk.weight", "up.weight"): (1e-3, 0.1),
        ("blk.bias", "lyr.dora_scale", "lyr.alpha", "lyr.lambda_layer", "lyr.rescale",
         "lyr.scalar", "norm.weight"): (1e-3, 0.0)}
    for g in groups:
        assert len(g["params"]) == len(g["param_names"])


@pytest.mark.parametrize("rule,wd", [("none", 0.0), ("all", 0.1)])
def test_none_and_all_rules_make_one_group(rule, wd):
    groups = param_groups(_named(**NAMED), _cfg(weight_decay=0.1, decay_rule=rule))
    assert len(groups) == 1 and groups[0]["weight_decay"] == wd
    assert groups[0]["param_names"] == [n.replace("__", ".") for n in NAMED]


def test_lr_multipliers_merge_by_lr_and_decay():
    named = _named(a__lora_up__weight=(4, 2), a__lora_down__weight=(2, 4),
                   b__lora_up__weight=(4, 2), a__bias=(4,), b__bias=(4,))
    named[-1][1].requires_grad_(False)  # frozen: left out
    scale = {"a.lora_up.weight": 16.0, "b.lora_up.weight": 16.0, "a.bias": 16.0}
    groups = param_groups(named, _cfg(lr=1e-4, weight_decay=0.01), scale)
    assert _by_names(groups) == {("a.lora_up.weight", "b.lora_up.weight"): (1.6e-3, 0.01),
                                 ("a.lora_down.weight",): (1e-4, 0.01),
                                 ("a.bias",): (1.6e-3, 0.0)}
    with pytest.raises(ValueError, match="lr_scale names"):
        param_groups(named, _cfg(), {"b.bias": 2.0})  # frozen
    with pytest.raises(ValueError, match="lr_scale names"):
        build_optimizer(named, _cfg(name="muon"), {"nope": 2.0})


# ---- the tiny DiT -------------------------------------------------------------------------

HW, LENS = [(2, 3), (3, 2)], [5, 4]


def _model(seed=0) -> MOSSImageTransformer:
    torch.manual_seed(seed)
    return MOSSImageTransformer(FLAVORS["tiny"]).float()


def _batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    c = FLAVORS["tiny"]
    n_img = sum(h * w for h, w in HW)
    return (torch.randn(n_img, c.latent_channels, generator=g),
            torch.randn(sum(LENS), c.text_dim, generator=g),
            torch.rand(len(HW), generator=g),
            torch.randn(n_img, c.latent_channels, generator=g))


LAYOUT = build_layout(HW, LENS)


def _train(model, opt, sched, steps, fixed_batch=False, clip=1.0) -> list[float]:
    losses = []
    for s in steps:
        img, txt, sigma, target = _batch(0 if fixed_batch else s)
        loss = torch.nn.functional.mse_loss(model(img, txt, sigma, LAYOUT), target)
        opt.zero_grad()
        loss.backward()
        _, finite = clip_and_check(model.parameters(), clip)
        assert finite
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("cfg", [_cfg(name="adamw", lr=3e-3, weight_decay=0.01),
                                 _cfg(name="muon", lr=3e-3, muon_lr=0.02, weight_decay=0.01)],
                         ids=["adamw", "muon"])
def test_optimizers_reduce_a_loss_on_the_tiny_dit(cfg):
    model = _model()
    opt = build_optimizer(list(model.named_parameters()), cfg)
    assert isinstance(opt, CombinedOptimizer if cfg.name == "muon" else torch.optim.AdamW)
    losses = _train(model, opt, None, range(8), fixed_batch=True)
    assert losses[-1] < 0.9 * losses[0], losses


def test_muon_takes_exactly_the_2d_block_weights():
    model = _model()
    named = list(model.named_parameters())
    opt = build_optimizer(named, _cfg(name="muon", weight_decay=0.1))
    muon, adamw = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    muon_names = {n for g in muon.param_groups for n in g["param_names"]}
    adamw_names = {n for g in adamw.param_groups for n in g["param_names"]}
    c = FLAVORS["tiny"]
    expected = {f"layers.{i}.proj.{k}.weight" for i in range(c.depth)
                for k in ("q", "k", "v", "o", "ffn_up_gate", "ffn_down")}
    expected |= {f"text_embedder.blocks.{i}.{k}.weight" for i in range(c.text_blocks)
                 for k in ("qkv", "proj", "ffn_gate", "ffn_up", "ffn_down")}
    assert muon_names == expected
    assert adamw_names == {n for n, _ in named} - expected
    for must in ("video_embedder.weight", "text_embedder.proj.weight", "time_embedding.0.weight",
                 "shared_block_modulation.weight", "final_linear_video.weight",
                 "layers.0.norm1.weight", "text_embedder.blocks.0.qkv.bias"):
        assert must in adamw_names
    assert {g["lr"] for g in muon.param_groups} == {0.02}
    assert all(g["momentum"] == 0.95 and g["ns_steps"] == 5 for g in muon.param_groups)
    decay = {n for g in adamw.param_groups if g["weight_decay"] for n in g["param_names"]}
    assert all(dict(named)[n].ndim == 2 for n in decay) and "video_embedder.weight" in decay
    # one group list for schedulers: parts' own dicts, Muon's first
    assert opt.param_groups == muon.param_groups + adamw.param_groups
    assert all(a is b for a, b in zip(opt.param_groups, muon.param_groups + adamw.param_groups))


def test_scheduler_scales_both_parts():
    model = _model()
    cfg = _cfg(name="muon", lr=1e-3, muon_lr=0.02, warmup_steps=4, schedule="cosine")
    opt = build_optimizer(list(model.named_parameters()), cfg)
    sched = build_scheduler(opt, cfg, total_steps=10)
    muon, adamw = opt.optimizers
    assert muon.param_groups[0]["lr"] == pytest.approx(0.02 / 4)
    assert adamw.param_groups[0]["lr"] == pytest.approx(1e-3 / 4)
    _train(model, opt, sched, range(2))
    assert muon.param_groups[0]["lr"] == pytest.approx(0.02 * 3 / 4)
    assert sched.get_last_lr()[-1] == pytest.approx(1e-3 * 3 / 4)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_resume_is_bit_identical(name):
    cfg = _cfg(name=name, lr=2e-3, muon_lr=0.02, weight_decay=0.05, warmup_steps=2,
               schedule="cosine", min_lr_ratio=0.1)
    n, k = 6, 3

    def fresh():
        model = _model()
        opt = build_optimizer(list(model.named_parameters()), cfg)
        return model, opt, build_scheduler(opt, cfg, n)

    model, opt, sched = fresh()
    full = _train(model, opt, sched, range(n))
    end = {k_: v.clone() for k_, v in model.state_dict().items()}

    model, opt, sched = fresh()
    first = _train(model, opt, sched, range(k))
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                           "sched": sched.state_dict()})
    del model, opt, sched
    model, opt, sched = fresh()
    _train(model, opt, sched, range(1))  # perturb the fresh state: loading must overwrite it
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    rest = _train(model, opt, sched, range(k, n))
    assert first + rest == full
    assert all(torch.equal(v, end[k_]) for k_, v in model.state_dict().items())
    if name == "muon":
        with pytest.raises(ValueError, match="1 parts"):
            opt.load_state_dict({"optimizers": saved["opt"]["optimizers"][:1]})


# ---- schedule ------------------------------------------------------------------------------

def test_lr_lambda_values():
    f = lr_lambda(_cfg(warmup_steps=4, schedule="cosine", min_lr_ratio=0.1), total_steps=14)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    assert all(f(s) > f(s + 1) for s in range(4, 14))

    lin = lr_lambda(_cfg(warmup_steps=0, schedule="linear", min_lr_ratio=0.2), total_steps=10)
    assert lin(0) == 1.0 and lin(5) == pytest.approx(0.6) and lin(10) == pytest.approx(0.2)

    const = lr_lambda(_cfg(warmup_steps=2, schedule="constant"), total_steps=10)
    assert [const(s) for s in (0, 1, 2, 9, 50)] == [0.5, 1.0, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="total_steps"):
        lr_lambda(_cfg(), 0)


# ---- clipping -----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_clip_reports_non_finite(bad):
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2))
    a.grad = torch.tensor([1.0, bad, 0.0])
    b.grad = torch.ones(2, 2)
    before = b.grad.clone()
    norm, finite = clip_and_check([a, b], 1.0)
    assert not finite and not math.isfinite(norm)
    assert torch.equal(b.grad, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clip_scales_a_large_grad_to_max_norm(dtype):
    a, b, c = (nn.Parameter(torch.zeros(s, dtype=dtype)) for s in [(4,), (3, 3), (2,)])
    a.grad = torch.full((4,), 300.0, dtype=dtype)
    b.grad = torch.full((3, 3), -400.0, dtype=dtype)
    norm, finite = clip_and_check([a, b, c], 2.0)  # c has no grad
    assert finite and norm == pytest.approx(math.sqrt(4 * 300**2 + 9 * 400**2))
    after = torch.linalg.vector_norm(torch.cat([a.grad.float(), b.grad.float().flatten()]))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert after.item() == pytest.approx(2.0, rel=tol)
    assert a.grad.dtype == dtype

    small = nn.Parameter(torch.zeros(2))
    small.grad = torch.tensor([0.3, 0.4])
    assert clip_and_check([small], 2.0) == (pytest.approx(0.5), True)
    assert torch.equal(small.grad, torch.tensor([0.3, 0.4]))  # below max_norm: untouched
    big = nn.Parameter(torch.zeros(2))
    big.grad = torch.tensor([30.0, 40.0])
    assert clip_and_check([big], 0.0) == (50.0, True)  # 0: off
    assert torch.equal(big.grad, torch.tensor([30.0, 40.0]))
    assert clip_and_check([nn.Parameter(torch.zeros(1))], 1.0) == (0.0, True)


# ---- EMA ----------------------------------------------------------------------------------

def test_ema_known_sequence_without_warmup():
    p = nn.Parameter(torch.tensor([0.0, 8.0]))
    ema = EMA([("p", p)], 0.5, warmup=False)
    expected = torch.tensor([0.0, 8.0], dtype=torch.float64)
    for value in [2.0, 4.0, -1.0]:
        with torch.no_grad():
            p.fill_(value)
        ema.update()
        expected = 0.5 * expected + 0.5 * value
    assert torch.allclose(ema.shadow["p"].double(), expected)
    assert ema.shadow["p"].tolist() == [0.75, 1.75]  # exact: dyadic values


def test_ema_warmup_decay():
    p = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    ema = EMA([("p", p)], 0.9)
    assert ema.shadow["p"].dtype == torch.float32
    decays = []
    for _ in range(200):
        decays.append(ema.current_decay())
        ema.update()
    assert decays[0] == pytest.approx(0.1) and decays[1] == pytest.approx(2 / 11)
    # (1 + n) / (10 + n) reaches 0.9 at n = (10 * 0.9 - 1) / (1 - 0.9) = 80
    assert decays[79] < 0.9 and decays[80] == 0.9 and decays[-1] == 0.9
    assert ema.num_updates == 200

    q = nn.Parameter(torch.zeros(1))
    ema = EMA([("q", q)], 0.9999)
    with torch.no_grad():
        q.fill_(1.0)
    ema.update()  # first update keeps 10 % of the start
    assert ema.shadow["q"].item() == pytest.approx(0.9)


def test_ema_swap_restores_live_weights_exactly():
    model = _model()
    named = [(n, p) for n, p in model.named_parameters()]
    ema = EMA(named, 0.9)
    opt = build_optimizer(named, _cfg(lr=1e-2))
    _train(model, opt, None, range(3))
    ema.update()
    live = {n: p.detach().clone() for n, p in named}
    with ema.swap():
        assert all(torch.equal(p, ema.shadow[n]) for n, p in named)
    assert all(torch.equal(p, live[n]) for n, p in named)

    other = _model(seed=5)
    ema.copy_to(list(other.named_parameters()))
    assert all(torch.equal(p, ema.shadow[n]) for n, p in other.named_parameters())
    with pytest.raises(ValueError, match="no parameter"):
        ema.copy_to([(n, p) for n, p in other.named_parameters() if n != "video_embedder.weight"])


def test_ema_state_dict_round_trip():
    params = _named(a=(3, 2), b=(4,))
    with torch.no_grad():
        for i, (_, p) in enumerate(params):
            p.normal_(generator=torch.Generator().manual_seed(i))
    ema = EMA(params, 0.95)
    for _ in range(3):
        with torch.no_grad():
            for _, p in params:
                p.add_(0.5)
        ema.update()
    saved = copy.deepcopy(ema.state_dict())
    resumed = EMA(params, 0.95)
    resumed.load_state_dict(saved)
    assert resumed.num_updates == 3 and resumed.current_decay() == ema.current_decay()
    ema.update()
    resumed.update()
    assert all(torch.equal(ema.shadow[n], resumed.shadow[n]) for n in ema.names)
    with pytest.raises(ValueError, match="missing"):
        EMA(params + _named(c=(2,)), 0.95).load_state_dict(saved)
