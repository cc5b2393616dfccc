"""The folding LoRAs' factors in the compute dtype, cast once per block and forward.

A LoRA's matrices live in float32 (``inject.py``); a bf16 or fp16 step runs its products
in the compute dtype. Cast one by one, every adapted linear costs four small kernels a
forward (``down`` and ``alpha B`` cast, their gradients cast back) and two more where
``alpha != 1``: ~1,000 kernel launches a step on the published model, each a few
microseconds of device time and a gap after it. Here the factors of one block's folding
LoRAs are cast together (``CastGroup``): one ``cat`` and one cast for the down matrices,
the same for the up matrices of each ``alpha`` (times ``alpha`` in float32 first), as one
autograd node each whose backward is one cast back (times ``alpha``). The values are the
one-by-one casts' exactly, and so are the gradients (``tests/test_adapters.py``). The
training adapters (``inject.apply_adapters``) and the files loaded for inference
(``formats.comfy.load_adapter_file``, in bypass) get them; ``Attached.remove`` takes them off.

A group's casts are made on its first member's call and reused while they hold: the same
model forward (``new_forward``, a forward pre-hook on the model, drops them, so a
recomputation in backward reuses the forward's), the same compute dtype and grad mode,
and the same parameter storage and version (an in-place write through the parameter).
The members are one repeated block's (``memory.overlap`` gates each block's parameters
before the block runs, so none is read before its update lands). Under a dispatch mode
(selective checkpointing's, which replays ops by their order) factors are cast per call.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import is_in_torch_dispatch_mode


class _JoinedCast(torch.autograd.Function):
    """``(cat(flattened tensors) * alpha).to(dtype)`` as one node; its backward casts the
    gradient back to the tensors' dtype (times ``alpha``) and splits it."""

    @staticmethod
    def forward(ctx, dtype, alpha, *tensors):
        ctx.shapes = [t.shape for t in tensors]
        ctx.alpha, ctx.master = alpha, tensors[0].dtype
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if alpha == 1.0:
            return flat.to(dtype)
        return torch.mul(flat, alpha, out=torch.empty(flat.shape, dtype=dtype, device=flat.device))

    @staticmethod
    def backward(ctx, grad):
        g = grad.to(ctx.master)
        if ctx.alpha != 1.0:  # in place on the cast (a new tensor: the dtypes differ)
            g = g.mul_(ctx.alpha) if g is not grad else g * ctx.alpha
        sizes = [s.numel() for s in ctx.shapes]
        return (None, None, *(p.view(s) for p, s in zip(g.split(sizes), ctx.shapes)))


def _alpha(lyco) -> float:
    return float(lyco.scale) * float(lyco.multiplier)


def _state(lyco) -> tuple:
    down, up = lyco.lora_down.weight, lyco.lora_up.weight
    return (down._version, up._version, down.data_ptr(), up.data_ptr(), _alpha(lyco))


class CastGroup:
    """The folding LoRA modules of one block; ``factors`` gives a member's cast matrices."""

    def __init__(self, members: list[nn.Module]):
        self.members = members
        self.casts: dict[int, tuple] = {}  # id(member) -> (its state, down, alpha up)
        self.mode: tuple | None = None  # (dtype, grad mode) of the casts held

    def drop(self) -> None:
        self.casts, self.mode = {}, None

    def factors(self, lyco, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(down, alpha * up)`` of member ``lyco`` in ``dtype`` (``alpha`` its scale times
        its multiplier), from the group's casts (made now if they do not hold)."""
        mode = (dtype, torch.is_grad_enabled())
        held = self.casts.get(id(lyco))
        if held is None or self.mode != mode or held[0] != _state(lyco):
            self._cast(dtype)
            held = self.casts[id(lyco)]
        return held[1], held[2]

    def _cast(self, dtype: torch.dtype) -> None:
        members = self.members
        states = [_state(m) for m in members]
        downs = _joined(dtype, 1.0, [m.lora_down.weight for m in members])
        ups: list[torch.Tensor | None] = [None] * len(members)
        for alpha in dict.fromkeys(s[-1] for s in states):
            idx = [i for i, s in enumerate(states) if s[-1] == alpha]
            for i, t in zip(idx, _joined(dtype, alpha, [members[i].lora_up.weight for i in idx])):
                ups[i] = t
        self.casts = {id(m): (s, d, u) for m, s, d, u in zip(members, states, downs, ups)}
        self.mode = (dtype, torch.is_grad_enabled())


def _joined(dtype: torch.dtype, alpha: float, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    flat = _JoinedCast.apply(dtype, alpha, *tensors)
    return [p.view(t.shape) for p, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def lora_factors(lyco, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(down, alpha * up)`` of a folding LoRA module in ``dtype``: its block's joint casts
    (``CastGroup``) where they apply, else cast here (what the joint casts equal exactly)."""
    down, up = lyco.lora_down.weight, lyco.lora_up.weight
    group = getattr(lyco, "kmoss_casts", None)
    if group is not None and down.dtype != dtype and down.device.type != "meta" \
            and not is_in_torch_dispatch_mode() and not torch.compiler.is_compiling():
        return group.factors(lyco, dtype)
    alpha = _alpha(lyco)
    up = up * alpha if alpha != 1.0 else up
    return (down if down.dtype == dtype else down.to(dtype)), (up if up.dtype == dtype else up.to(dtype))


def block_paths(model: nn.Module) -> list[str]:
    """The module paths of ``model``'s repeated blocks (``model.dit.REPEATED``) it has."""
    from kohakumoss.model.dit import REPEATED

    paths = []
    for name in REPEATED:
        try:
            blocks = model.get_submodule(name)
        except AttributeError:
            continue
        if isinstance(blocks, nn.ModuleList):
            paths += [f"{name}.{i}" for i in range(len(blocks))]
    return paths


def attach_cast_groups(model: nn.Module, modules: dict[str, nn.Module]):
    """Give the LoRA/LoCon modules on linears (``modules``: module path -> LyCORIS module)
    one ``CastGroup`` per repeated block of ``model``, and ``model`` a forward pre-hook that
    drops every group's casts; returns the hook's handle (None without groups). Modules
    outside the blocks keep their own casts."""
    from kohakumoss.adapters.runtime import kind_of

    blocks = block_paths(model)
    groups = []
    for block in blocks:
        members = [lyco for path, lyco in modules.items() if path.startswith(block + ".")
                   and kind_of(lyco) == "locon" and lyco.module_type == "linear"]
        if members:
            group = CastGroup(members)
            for lyco in members:
                lyco.kmoss_casts = group
            groups.append(group)
    if not groups:
        return None

    def new_forward(module, args):
        for group in groups:
            group.drop()

    return model.register_forward_pre_hook(new_forward)


def detach_cast_groups(modules: dict[str, nn.Module], handle) -> None:
    """Undo ``attach_cast_groups``: the modules cast their own factors again."""
    if handle is not None:
        handle.remove()
    for lyco in modules.values():
        lyco.__dict__.pop("kmoss_casts", None)
