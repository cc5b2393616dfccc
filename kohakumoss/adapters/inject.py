"""Adapters for training: ``apply_adapters(model, cfg, seed)`` builds one LyCORIS module per
targeted linear (``docs/adapters.md``) and returns the ``AdapterSet`` a trainer
drives: parameters and optimiser groups, per-step randomness, train/eval, merge, state.
Its LyCORIS file is written by ``kohakumoss.formats.lycoris``.

The base model is frozen and keeps its state-dict keys: LyCORIS wraps a layer's ``forward``
and holds its own parameters outside the model. Names are LyCORIS's
(``lora_unet_<path with . -> _>``); parameters live in float32 (float64 on a float64 base).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from lycoris import LycorisNetwork
from lycoris.modules.tlora import clear_timestep_mask, compute_timestep_mask, set_timestep_mask
from torch import nn

from kohakumoss.adapters.casts import attach_cast_groups
from kohakumoss.adapters.norms import NormDelta
from kohakumoss.adapters.options import NETWORK_MODULE, check_options
from kohakumoss.adapters.presets import (resolve_norm_targets, resolve_targets,
                                         targeted_modules)
from kohakumoss.adapters.runtime import Attached, kind_of, master_dtype, quiet_lycoris
from kohakumoss.adapters.ops import ADAPTER_OPS
from kohakumoss.adapters.shared import SharedInputLinears
from kohakumoss.model.dit import MOSSImageTransformer
from kohakumoss.model.ops import OpTable

PREFIX = "lora_unet"
TLORA_DEFAULTS = {"mask_min_rank": 1, "mask_alpha": 1.0, "mask_max_timestep": 1000}
# the zero-initialised factor(s) of each kind: LoRA+ gives them lr * ratio (docs/adapters.md#algorithms, docs/adapters.md#optimizer-groups)
LORA_PLUS = {"locon": ("lora_up.weight",), "loha": ("hada_w2_a",), "lokr": ("lokr_w2", "lokr_w2_b"),
             "glora": ("a2.weight", "b2.weight"), "dylora": ("up_list",), "tlora": ("p_layer.weight",)}
NO_DECAY = ("dora_scale", "rescale", "scalar", "lambda_layer", "alpha")
DECAY_RULES = ("moss", "none", "all")
AXES = ("joint", "text", "image", "sample")  # T-LoRA mask groups: one mask row per token
_MASK_IDS = itertools.count(1 << 20, len(AXES))


def lora_name(path: str) -> str:
    return f"{PREFIX}_{path.replace('.', '_')}"


def token_axis(path: str) -> str:
    """Which token axis a layer's rows run over (the T-LoRA mask group)."""
    if path.startswith("layers."):
        return "joint"
    if path.startswith("text_embedder."):
        return "text"
    if path in ("video_embedder", "final_linear_video"):
        return "image"
    return "sample"  # time embedding and modulations: one row per sample


def step_seed(seed: int, step: int, micro: int) -> int:
    """The per-(step, micro-batch) host generator seed of ``docs/adapters.md#dropouts-and-per-step-randomness``."""
    return (seed * 1000003 + step * 1009 + micro) % (2**63 - 1)


def lycoris_preset(regexes: list[str]) -> dict:
    return {"enable_conv": False, "target_module": [], "target_name": list(regexes),
            "module_algo_map": {}, "name_algo_map": {}, "use_fnmatch": False,
            "exclude_name": [], "lora_prefix": PREFIX}


def apply_adapters(model: nn.Module, cfg, seed: int, device: torch.device | str | None = None
                   ) -> AdapterSet:
    """Freeze ``model`` and put ``cfg``'s adapter on its targeted layers (init seeded by
    ``seed``), its tensors on ``device`` (default: each layer's; a base of shapes only, on the
    meta device, takes an adapter whose state is then loaded: ``formats.load_trained``)."""
    check_options(cfg)
    regexes = resolve_targets(cfg)
    paths = targeted_modules(model, regexes)
    norm_paths = (targeted_modules(model, resolve_norm_targets(cfg), "norm", check=False)
                  if cfg.train_norms else [])
    if not paths:
        raise ValueError(f"adapter targets {regexes} select no linear layer")
    kwargs = {k: v for k, v in cfg.algo_kwargs.items() if k not in TLORA_DEFAULTS}
    LycorisNetwork.apply_preset(lycoris_preset(regexes))
    model.requires_grad_(False)
    with torch.random.fork_rng(devices=[]), quiet_lycoris():
        torch.manual_seed(seed)
        network = LycorisNetwork(
            model, multiplier=1.0, lora_dim=cfg.dim, alpha=cfg.alpha, dropout=cfg.dropout,
            rank_dropout=cfg.rank_dropout, module_dropout=0.0,
            network_module=NETWORK_MODULE[cfg.algo], train_norm=False,
            bypass_mode=cfg.mode == "bypass", weight_decompose=cfg.dora or cfg.algo == "dora",
            warn_on_unmatched=False, **kwargs)
    by_name = {lyco.lora_name: lyco for lyco in network.loras}
    assert sorted(by_name) == sorted(lora_name(p) for p in paths), "LyCORIS matched other layers"
    modules = {}
    for path in paths:
        lyco, base = by_name[lora_name(path)], model.get_submodule(path)
        lyco.to(device=device or base.weight.device, dtype=master_dtype(base.weight, lyco)).requires_grad_(True)
        network.add_module(lyco.lora_name, lyco)
        modules[path] = lyco
    norms = {}
    for path in norm_paths:
        w = model.get_submodule(path).weight
        norms[path] = NormDelta(lora_name(path), model.get_submodule(path), master_dtype(w))
    aset = AdapterSet(cfg, seed, network, modules, norms, model)
    aset.attached.cast_hook = attach_cast_groups(model, modules)  # adapters/casts.py
    if isinstance(model, MOSSImageTransformer):
        # q, k and v as one LoRA node where all three fold (adapters/shared.py)
        model.ops.override("linears", SharedInputLinears(aset.ops))
    return aset


class AdapterSet:
    """The adapters of one training run; a thin layer over the LyCORIS modules."""

    def __init__(self, cfg, seed: int, network: LycorisNetwork,
                 modules: dict[str, nn.Module], norms: dict[str, NormDelta],
                 model: nn.Module | None = None):
        self.cfg, self.seed, self.network = cfg, seed, network
        self.ops = OpTable(ADAPTER_OPS)  # the LoRA nodes' narrow products (``adapters/ops.py``)
        self.modules, self.norms = modules, norms
        self.attached = Attached(modules, norms, 1.0, bypass=cfg.mode == "bypass", model=model)
        self.mask_groups = dict(zip(AXES, itertools.count(next(_MASK_IDS))))
        self.masks: dict[str, torch.Tensor] = {}
        for path, lyco in modules.items():
            if kind_of(lyco) == "tlora":
                lyco.mask_group_id = self.mask_groups[token_axis(path)]
        self.train()

    def to(self, device: torch.device | str) -> "AdapterSet":
        """Every module and norm delta to ``device`` (parameters stay the same objects)."""
        for module in [*self.modules.values(), *self.norms.values()]:
            module.to(device)
        self.masks = {}
        return self

    # -- parameters ------------------------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for lyco in self.modules.values():
            for name, p in lyco.named_parameters():
                yield f"{lyco.lora_name}.{name}", p
        for n in self.norms.values():
            yield f"{n.lora_name}.w_norm", n.w_norm

    def named_trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad]

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_trainable()]

    def lr_group(self, name: str) -> str:
        """Where trained tensor ``name`` sits: ``norms`` (a trained norm), ``text_refiner``
        or ``blocks`` (the joint blocks and every other target)."""
        if name.endswith(".w_norm"):
            return "norms"
        return "text_refiner" if name.startswith("lora_unet_text_embedder_") else "blocks"

    def lr_scale(self) -> dict[str, float]:
        """Each trained tensor's learning-rate factor other than 1: its group's
        (``adapter.lr_blocks``, ``lr_text_refiner``, ``lr_norms``) times, for each
        zero-initialised factor, LoRA+'s ``loraplus_ratio``."""
        c, ratio = self.cfg, self.cfg.loraplus_ratio
        groups = {"blocks": c.lr_blocks, "text_refiner": c.lr_text_refiner, "norms": c.lr_norms}
        plus = set() if ratio == 1 else {
            f"{lyco.lora_name}.{n}" for lyco in self.modules.values()
            for n, p in lyco.named_parameters() if p.requires_grad
            and any(n == f or n.startswith(f + ".") for f in LORA_PLUS.get(kind_of(lyco), ()))}
        out = {}
        for name, _ in self.named_trainable():
            f = groups[self.lr_group(name)] * (ratio if name in plus else 1.0)
            if f != 1.0:
                out[name] = f
        return out

    def param_groups(self, lr: float, weight_decay: float = 0.0,
                     decay_rule: str = "moss") -> list[dict]:
        """Optimiser groups: LoRA+ (``lr * loraplus_ratio`` for the zero-initialised factors)
        crossed with the weight-decay rule (``moss``: none for 1-D tensors and for
        dora_scale/rescale/scalar/lambda_layer/alpha; ``none``; ``all``)."""
        if decay_rule not in DECAY_RULES:
            raise ValueError(f"decay_rule {decay_rule!r}: one of {', '.join(DECAY_RULES)}")
        scale, groups = self.lr_scale(), {}
        for name, p in self.named_trainable():
            local = name.split(".", 1)[1]
            decay = decay_rule == "all" or (decay_rule == "moss" and p.ndim > 1
                                            and not any(s in local for s in NO_DECAY))
            g = groups.setdefault((scale.get(name, 1.0), decay), {
                "params": [], "param_names": [], "lr": lr * scale.get(name, 1.0),
                "weight_decay": weight_decay if decay else 0.0})
            g["params"].append(p)
            g["param_names"].append(name)
        return list(groups.values())

    # -- per-step randomness ---------------------------------------------------------
    def prepare_step(self, step: int, micro: int = 0, sigmas: torch.Tensor | None = None,
                     layout=None) -> dict:
        """Draw this (step, micro-batch)'s module-dropout skips and DyLoRA ranks from the
        host generator of ``docs/adapters.md#dropouts-and-per-step-randomness``, and install T-LoRA's per-token rank masks from each
        token's sample sigma (``layout``: the batch's ``PackedLayout``). Returns the draws."""
        draws: dict = {"skipped": [], "blocks": {}}
        if not self.training:
            return draws
        g = torch.Generator().manual_seed(step_seed(self.seed, step, micro))
        items = list(self.modules.items())
        p = self.cfg.module_dropout
        skip = (torch.rand(len(items), generator=g) < p).tolist() if p > 0 else [False] * len(items)
        for (path, lyco), s in zip(items, skip):
            lyco.kmoss_skip = s
            if s:
                draws["skipped"].append(path)
        for path, lyco in items:
            if kind_of(lyco) == "dylora":
                lyco.kmoss_blocks = int(torch.randint(1, lyco.block_count + 1, (1,), generator=g))
                draws["blocks"][path] = lyco.kmoss_blocks
        if any(kind_of(lyco) == "tlora" for lyco in self.modules.values()):
            if sigmas is None:
                self._clear_masks()
            else:
                self._install_masks(sigmas, layout)
        return draws

    def tlora_ranks(self, sigmas: torch.Tensor) -> list[int]:
        """Active T-LoRA ranks per sample: r_i = min(r, floor(((T - t)/T)^a (r - r_min)) + r_min)."""
        return [int(m.sum()) for m in self._sample_masks(sigmas)]

    def _sample_masks(self, sigmas: torch.Tensor) -> torch.Tensor:
        kw = {**TLORA_DEFAULTS, **self.cfg.algo_kwargs}
        T = kw["mask_max_timestep"]
        return torch.cat([compute_timestep_mask(float(s) * T, T, self.cfg.dim, kw["mask_min_rank"],
                                                kw["mask_alpha"]) for s in sigmas.detach().cpu()])

    def _install_masks(self, sigmas: torch.Tensor, layout) -> None:
        if layout is None:
            raise ValueError("T-LoRA needs the batch layout to place per-token rank masks")
        mask_B = self._sample_masks(sigmas)
        device = next(iter(self.modules.values())).lambda_layer.device
        rows = {"joint": layout.seg_joint, "text": layout.seg_txt, "image": layout.seg_img,
                "sample": torch.arange(len(mask_B))}
        for axis, gid in self.mask_groups.items():
            self.masks[axis] = mask_B[rows[axis].long().cpu()].to(device)
            set_timestep_mask(self.masks[axis], gid)

    def _clear_masks(self) -> None:
        for gid in self.mask_groups.values():
            clear_timestep_mask(gid)
        self.masks = {}

    def train(self, mode: bool = True) -> AdapterSet:
        """Dropouts, module skips, DyLoRA draws and T-LoRA masks on (they take effect from
        the next ``prepare_step``) or off (``mode=False``: full rank, no dropout)."""
        self.training = mode
        self.attached.train(mode)
        if not mode:
            self._clear_masks()
        return self

    def eval(self) -> AdapterSet:
        return self.train(False)

    # -- inference -------------------------------------------------------------------
    def set_multiplier(self, multiplier: float) -> None:
        self.attached.set_multiplier(multiplier)

    def set_mode(self, mode: str) -> None:
        """Switch the forward between ``bypass`` and ``merge`` (weight rebuilt per forward)."""
        self.attached.set_bypass(mode == "bypass")

    def merge(self, multiplier: float = 1.0) -> None:
        self.attached.merge(multiplier)

    def unmerge(self) -> None:
        self.attached.unmerge()

    def remove(self) -> None:
        """Take every adapter off the model (its weights and forwards restored exactly)."""
        self.attached.remove()
        self._clear_masks()

    # -- state -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Raw adapter state: every parameter and persistent buffer (incl. T-LoRA's frozen
        base factors, DyLoRA's blocks) as ``<lora_name>.<torch name>``, uncast."""
        out = {}
        for lyco in self.modules.values():
            for k, v in nn.Module.state_dict(lyco).items():
                out[f"{lyco.lora_name}.{k}"] = v.detach().clone()
        for n in self.norms.values():
            out[f"{n.lora_name}.w_norm"] = n.w_norm.detach().clone()
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        own = self.state_dict()
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise ValueError(f"adapter state does not fit this adapter: missing {missing[:4]}"
                             f"{'...' if len(missing) > 4 else ''}, unexpected {unexpected[:4]}"
                             f"{'...' if len(unexpected) > 4 else ''}")
        for lyco in [*self.modules.values(), *self.norms.values()]:
            tensors = {**dict(lyco.named_parameters()), **dict(lyco.named_buffers())}
            for k in nn.Module.state_dict(lyco):
                tensors[k].copy_(state[f"{lyco.lora_name}.{k}"])
