"""How one LyCORIS module runs on its base layer, what weight it merges to, and a set of
modules attached to a model (run as forwards, or merged into the weights and restored
bit-exactly).

Each module keeps LyCORIS 4.1.3's own math; this file only routes around its quirks:

- LoHa/LoKr ``get_diff_weight``/``get_merged_weight`` apply ``alpha/r`` twice (their
  ``get_weight`` already holds it), so their merged weight is built from ``get_weight``.
- LyCORIS's bypass forward of LoCon/LoHa/LoKr ignores DoRA; DoRA layers always run the
  weight-rebuild forward (``W'`` is formed, ``docs/adapters.md#forward-modes``). At a multiplier ``m != 1`` DoRA
  follows ``docs/adapters.md#algorithms`` (DoRA), ``W + m (W'_1 - W)``, instead of LyCORIS's ``(W + dW)(m(rho-1)+1)``.
- OFT/BOFT/IA3 transform the base output, bias included, in bypass, while their rebuild
  forward changes only the weight: on a layer with a bias they always run bypass, and the
  merged bias is the bias transformed the same way.
- DyLoRA's bypass forward is broken in 4.1.3 (no scale, fails for a partial rank): it runs
  ``up(down(x))`` from ``get_weight(rank)`` here. ``rank`` follows LyCORIS's own draw:
  ``n`` active blocks use ``get_weight((n - 1) * block_size)`` (blocks ``0..n-1``, the
  last one trained, scale ``alpha / n``); eval and export use all blocks, ``alpha / blocks``.
- OFT/BOFT compute their rotation in float32 (``.float().inverse()``), so their parameters
  stay float32 and they run at float32 precision even in a float64 model.
- The strength (multiplier) rule is one for every kind (``docs/adapters.md#strength``): at
  ``m`` the layer is ``W + m dW``, ``b + m db``, with ``(dW, db)`` its change at 1
  (``weight_delta``), and ``m = 0`` is the base layer exactly. LyCORIS's own rule differs for
  OFT/BOFT (it interpolates the rotation and leaves ``rescale`` unscaled, so ``m = 0`` is
  not the base; DiagOFT's bypass at ``m != 1`` also fails on a non-contiguous view): here
  their forward at ``m`` is ``base + m (forward at 1 - base)``, as DoRA's is.
  ``native_merged_weight`` keeps LyCORIS's rule (what ComfyUI builds on for OFT/BOFT blocks).
- OFT/BOFT/T-LoRA/IA3/DoRA/diff fail (or leak float32 into the next layer) when the
  activation dtype differs from theirs outside autocast (a bf16 or float64 model): they run
  on the base output cast to their dtype and return the activation dtype.
- Module dropout is ours (per-step host generator), not LyCORIS's ``torch.rand``.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import types

import torch
import torch.nn.functional as F
from lycoris.functional.diag_oft import bypass_forward_diff as oft_bypass_diff
from lycoris.functional.general import weight_decompose
from lycoris.logging import logger as lycoris_logger
from lycoris.modules import (ButterflyOFTModule, DiagOFTModule, DyLoraModule, FullModule,
                             GLoRAModule, IA3Module, LoConModule, LohaModule, LokrModule,
                             TLoraModule)
from lycoris.modules.base import LycorisBaseModule
from torch import nn

from kohakumoss.adapters.casts import detach_cast_groups
from kohakumoss.adapters.folded import folded_forward
from kohakumoss.adapters.norms import NormDelta
from kohakumoss.model.dit import MOSSImageTransformer
from kohakumoss.model.engines import Handle

log = logging.getLogger(__name__)

ENGINE = "adapter"  # its handles' names in a model's engine registry, one per attached set
KINDS = {LoConModule: "locon", LohaModule: "loha", LokrModule: "lokr", DiagOFTModule: "oft",
         ButterflyOFTModule: "boft", GLoRAModule: "glora", IA3Module: "ia3",
         DyLoraModule: "dylora", TLoraModule: "tlora", FullModule: "diff"}
BASE_OUTPUT = frozenset({"oft", "boft", "ia3"})  # transform the base layer's output


@contextlib.contextmanager
def quiet_lycoris():
    """While building modules: LyCORIS's per-module INFO lines muted and its per-module
    ``print`` warnings logged once each; T-LoRA's per-module ``gc.collect()`` (~0.1 s each)
    replaced by one collection at the end."""
    import lycoris.modules.tlora as tlora

    level, gc_module, printed, skipped = lycoris_logger.level, tlora.gc, io.StringIO(), []
    lycoris_logger.setLevel(max(level, logging.WARNING))
    tlora.gc = types.SimpleNamespace(collect=lambda *a: skipped.append(1) or 0)
    try:
        with contextlib.redirect_stdout(printed):
            yield
    finally:
        lycoris_logger.setLevel(level)
        tlora.gc = gc_module
        if skipped:
            gc_module.collect()
        for line in dict.fromkeys(printed.getvalue().splitlines()):
            log.warning("LyCORIS: %s", line)


def kind_of(lyco: nn.Module) -> str:
    return KINDS[type(lyco)]


def master_dtype(t: torch.Tensor, lyco: nn.Module | None = None) -> torch.dtype:
    """Adapter parameters live in float32, or float64 on a float64 base; OFT/BOFT stay float32
    (LyCORIS inverts the Cayley factor with ``.float()`` and cannot mix it with float64)."""
    if lyco is not None and kind_of(lyco) in ("oft", "boft"):
        return torch.float32
    return torch.promote_types(t.dtype, torch.float32)


def dylora_rank(lyco: DyLoraModule, blocks: int | None = None) -> int:
    """The ``get_weight`` rank argument that selects ``blocks`` (default all) rank blocks."""
    return ((blocks or lyco.block_count) - 1) * lyco.block_size


def runs_bypass(lyco: nn.Module, bypass: bool) -> bool:
    kind = kind_of(lyco)
    if kind == "diff" or getattr(lyco, "wd", False):
        return False
    if kind in BASE_OUTPUT and lyco.org_module[0].bias is not None:
        return True
    return bypass


def _dylora_forward(lyco: DyLoraModule, x: torch.Tensor) -> torch.Tensor:
    blocks = lyco.kmoss_blocks if lyco.training else None
    rank = dylora_rank(lyco, blocks)
    y = lyco.org_forward(x)
    if not lyco.bypass_mode:
        return y + F.linear(x, lyco.get_diff_weight(lyco.multiplier, rank=rank)[0].to(x))
    down, up, scale = lyco.get_weight(rank)
    h = F.linear(F.linear(x, down.to(x)), up.to(x))
    return y + lyco.drop(h * (scale * lyco.multiplier).to(x))


def _oft_bias_shift(lyco: DiagOFTModule, like: torch.Tensor) -> torch.Tensor | int:
    """``R b - b`` (rescale included) at multiplier 1, or 0 for a layer without bias."""
    b = lyco.org_module[0].bias
    if b is None:
        return 0
    rescale = lyco.rescale if lyco.rescaled else None
    shift = oft_bypass_diff(None, b[None].to(lyco.oft_blocks), lyco.oft_blocks, rescale,
                            constraint=lyco.constraint)
    return shift[0].to(like)


def folds(lyco: LycorisBaseModule) -> bool:
    """Whether this layer's LoRA delta folds into its base matmul (``folded.folded_forward``): a LoRA or
    LoCon on a linear in bypass mode, without DoRA, a Tucker core, a trained scalar, or a
    dropout drawing now."""
    return (kind_of(lyco) == "locon" and lyco.bypass_mode and lyco.module_type == "linear"
            and not lyco.tucker and not getattr(lyco, "wd", False)
            and not isinstance(lyco.scalar, nn.Parameter)
            and not (lyco.training and (lyco.rank_dropout or _drops(lyco.dropout))))


def _drops(dropout) -> bool:
    return isinstance(dropout, nn.Dropout) and dropout.p > 0 or (
        isinstance(dropout, float) and dropout > 0)


def _math(lyco: LycorisBaseModule, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    kind, m = kind_of(lyco), lyco.multiplier
    if m == 0:  # strength 0: the base layer, exactly
        return lyco.org_forward(x, *args, **kwargs)
    if not args and not kwargs and folds(lyco):
        return folded_forward(lyco, x)
    if m != 1 and (kind in ("oft", "boft") or getattr(lyco, "wd", False)):
        base = lyco.org_forward(x)  # the strength rule: base + m (full - base)
        lyco.multiplier = 1.0
        try:
            full = type(lyco).forward(lyco, x)
        finally:
            lyco.multiplier = m
        return base + m * (full - base)
    return type(lyco).forward(lyco, x, *args, **kwargs)


def _needs_own_dtype(lyco: LycorisBaseModule) -> bool:
    """Whether LyCORIS's forward of this module fails on (or leaks its dtype into) an
    activation of another dtype: DoRA's and diff's rebuilt delta, and the bypass of the
    kinds that transform the base output or mix float32 factors into it."""
    kind = kind_of(lyco)
    if getattr(lyco, "wd", False) or kind == "diff":
        return True
    if not lyco.bypass_mode:
        return False
    return kind in ("oft", "boft", "tlora", "ia3")


def _run(lyco: LycorisBaseModule, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The forward installed on a base layer (through LyCORIS's wrapper chain)."""
    if lyco.training and lyco.kmoss_skip:
        return lyco.org_forward(x, *args, **kwargs)
    kind, dt = kind_of(lyco), lyco.dtype_tensor.dtype
    if kind == "dylora":
        return _dylora_forward(lyco, x)
    if x.dtype != dt and _needs_own_dtype(lyco) and not torch.is_autocast_enabled(x.device.type):
        # LyCORIS mixes these kinds' tensors with the activation dtype and fails (or leaks its
        # dtype into the next layer): run the adapter math in its own dtype on the base output
        # of the untouched input, and return the activation dtype
        org = lyco.org_forward
        lyco.org_forward = lambda *_a, **_k: org(x, *args, **kwargs).to(dt)
        try:
            return _math(lyco, x.to(dt)).to(x.dtype)
        finally:
            lyco.org_forward = org
    return _math(lyco, x, *args, **kwargs)


def install(lyco: LycorisBaseModule) -> None:
    if "forward" not in lyco.__dict__:
        lyco.kmoss_skip, lyco.kmoss_blocks = False, None
        lyco.forward = functools.partial(_run, lyco)
    LycorisBaseModule.apply_to(lyco)


def uninstall(lyco: LycorisBaseModule) -> None:
    base = lyco.org_module[0]
    LycorisBaseModule.restore(lyco)
    if not getattr(base, "_lycoris_wrappers", None):
        for attr in ("forward", "_lycoris_original_forward", "_lycoris_wrappers"):
            base.__dict__.pop(attr, None)


@contextlib.contextmanager
def _on_master_copy(lyco: LycorisBaseModule):
    """LyCORIS's weight math on a master-dtype copy of the base layer, full rank, eval."""
    base = lyco.org_module[0]
    dt = next(p for p in lyco.parameters() if p.is_floating_point()).dtype
    proxy = nn.Linear(1, 1, bias=base.bias is not None, device="meta")
    proxy.weight = nn.Parameter(base.weight.detach().to(dt), requires_grad=False)
    if base.bias is not None:
        proxy.bias = nn.Parameter(base.bias.detach().to(dt), requires_grad=False)
    saved = lyco.org_module, lyco.org_forward, lyco.training, getattr(lyco, "mask_group_id", None)
    lyco.org_module, lyco.org_forward = [proxy], proxy.forward
    lyco.train(False)
    if kind_of(lyco) == "tlora":
        lyco.mask_group_id = None  # no mask under this id: full rank
    try:
        yield proxy
    finally:
        lyco.org_module, lyco.org_forward = saved[0], saved[1]
        lyco.train(saved[2])
        if kind_of(lyco) == "tlora":
            lyco.mask_group_id = saved[3]


def _additive_delta(lyco: LycorisBaseModule, like: torch.Tensor) -> torch.Tensor:
    """LoCon/LoHa/LoKr's ``dW`` from its factors (inside ``_on_master_copy``); LoHa/LoKr's
    ``get_diff_weight`` would apply ``alpha/r`` twice."""
    d = lyco.get_diff_weight(1.0)[0] if kind_of(lyco) == "locon" else \
        lyco.get_weight(lyco.shape) * lyco.scalar
    return d.to(like.dtype).view(like.shape)  # where the adapter is (a base of shapes: meta)


@torch.no_grad()
def native_merged_weight(lyco: LycorisBaseModule, m: float
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer's (weight, bias) at multiplier ``m`` by LyCORIS's own rule, in master dtype:
    the strength rule at ``m = 1``; for OFT/BOFT at other ``m`` the interpolated rotation (with
    ``rescale`` unscaled), which ComfyUI's OFT/BOFT adapters build on."""
    kind = kind_of(lyco)
    with _on_master_copy(lyco) as base:
        W, b = base.weight, base.bias
        if kind in ("locon", "loha", "lokr"):
            d = _additive_delta(lyco, W)
            if lyco.wd:
                W1 = weight_decompose(W + d, lyco.dora_scale.to(W), 1, lyco.wd_on_out)
                Wm = W + m * (W1 - W)
            else:
                Wm = W + m * d
        elif kind == "dylora":
            Wm = lyco.get_merged_weight(m, rank=dylora_rank(lyco))[0]
        elif kind == "diff":
            Wm, bm = lyco.get_merged_weight(m, device=W.device)
            b = b if bm is None else bm.to(W)
        else:
            Wm = lyco.get_merged_weight(m)[0]
        if kind == "oft" and b is not None:
            b = b + m * _oft_bias_shift(lyco, b)
        elif kind in BASE_OUTPUT and b is not None:
            b = lyco.bypass_forward(torch.zeros(1, W.shape[1], dtype=W.dtype, device=W.device), m)[0]
        return Wm.to(W).view(W.shape), b


@torch.no_grad()
def weight_delta(lyco: LycorisBaseModule) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer's change at multiplier 1, ``(dW, db)`` in master dtype (``db`` None where
    the bias cannot move or there is none). An additive kind's ``dW`` comes straight from
    its factors."""
    kind, base = kind_of(lyco), lyco.org_module[0]
    if kind in ("locon", "loha", "lokr") and not lyco.wd:
        with _on_master_copy(lyco) as proxy:
            return _additive_delta(lyco, proxy.weight), None
    W1, b1 = native_merged_weight(lyco, 1.0)
    dW = W1 - base.weight.detach().to(W1)
    return dW, None if base.bias is None else b1.to(W1) - base.bias.detach().to(W1)


@torch.no_grad()
def merged_weight(lyco: LycorisBaseModule, m: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer's effective (weight, bias) at multiplier ``m``, in master dtype, by the one
    strength rule: ``W + m dW``, ``b + m db`` (``m = 0``: the base exactly)."""
    if m == 1:
        return native_merged_weight(lyco, 1.0)
    dW, db = weight_delta(lyco)
    base = lyco.org_module[0]
    W = base.weight.detach().to(dW)
    b = None if base.bias is None else base.bias.detach().to(dW)
    return W + m * dW, (b if db is None else b + m * db)


class Attached:
    """LyCORIS modules and norm deltas on a model's layers; a handle for inference.

    ``merge(m)`` folds every adapter into its layer's weight (master-dtype math, rounded once
    to the weight dtype) and keeps exact copies; ``unmerge``/``remove`` restore them bit-exactly.
    """

    def __init__(self, modules: dict[str, LycorisBaseModule], norms: dict[str, NormDelta],
                 multiplier: float = 1.0, bypass: bool = True, model: nn.Module | None = None):
        self.modules, self.norms = modules, norms
        # the model's engine registry (``model/engines.py``) is told which linears run
        # LyCORIS's forward while they do: they are never plain products
        self.registry = model.engines if isinstance(model, MOSSImageTransformer) else None
        self._handle: Handle | None = None
        self.cast_hook = None  # the model's hook renewing the blocks' joint casts (casts.py)
        self._saved: dict[str, tuple[torch.Tensor, torch.Tensor | None]] | None = None
        self.set_multiplier(multiplier)
        self.set_bypass(bypass)
        self._attach()

    def _attach(self) -> None:
        for lyco in self.modules.values():
            install(lyco)
        for n in self.norms.values():
            n.attach()
        if self.registry is not None and self._handle is None:
            self._handle = self.registry.register(Handle(
                f"{ENGINE} {id(self):x}", state=self,
                linears=tuple(lyco.org_module[0] for lyco in self.modules.values())))

    def _detach(self) -> None:
        for lyco in self.modules.values():
            uninstall(lyco)
        for n in self.norms.values():
            n.detach()
        if self._handle is not None:
            self.registry.remove(self._handle)
            self._handle = None

    def set_multiplier(self, multiplier: float) -> None:
        for a in [*self.modules.values(), *self.norms.values()]:
            a.multiplier = float(multiplier)

    def train(self, mode: bool = True) -> None:
        for a in [*self.modules.values(), *self.norms.values()]:
            a.train(mode)

    def set_bypass(self, bypass: bool) -> None:
        for lyco in self.modules.values():
            lyco.bypass_mode = runs_bypass(lyco, bypass)

    @property
    def merged(self) -> bool:
        return self._saved is not None

    def _targets(self):
        for path, lyco in self.modules.items():
            yield path, lyco.org_module[0]
        for path, n in self.norms.items():
            yield path, n.target[0]

    @torch.no_grad()
    def merge(self, multiplier: float = 1.0) -> None:
        if self.merged:
            raise RuntimeError("adapters are already merged; unmerge() first")
        for path, layer in self._targets():
            if "weight" not in layer._parameters:  # a quantized base (precision.base)
                raise RuntimeError(f"{path}: the base weight is held quantized and cannot be merged "
                                   f"into; run the adapters as forwards, or load the base with "
                                   f"precision.base: keep")
        new = {p: merged_weight(lyco, multiplier) for p, lyco in self.modules.items()}
        new.update({p: (n.merged_weight(multiplier), None) for p, n in self.norms.items()})
        self._saved = {}
        self._detach()
        for path, layer in self._targets():
            w, b = layer._parameters["weight"], layer._parameters.get("bias")
            self._saved[path] = (w.detach().clone(), None if b is None else b.detach().clone())
            w.copy_(new[path][0].to(w.dtype))
            if new[path][1] is not None:
                b.copy_(new[path][1].to(b.dtype))

    @torch.no_grad()
    def unmerge(self) -> None:
        if not self.merged:
            return
        for path, layer in self._targets():
            w, b = self._saved[path]
            layer._parameters["weight"].copy_(w)
            if b is not None:
                layer._parameters["bias"].copy_(b)
        self._saved = None
        self._attach()

    def remove(self) -> None:
        """Restore the model exactly: weights (if merged) and forwards."""
        if self.merged:
            self.unmerge()
        self._detach()
        detach_cast_groups(self.modules, self.cast_hook)
        self.cast_hook = None
