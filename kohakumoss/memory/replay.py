"""What activation offload's recomputation need not run again (``docs/memory.md, "Activation offload"``).

Backward recomputes a checkpointed part (a block, or half of one) to get what autograd saves
for its backward. Two things in it are only there for their values, and both can be had
without running them:

- **The attention kernel.** Forward records the kernel's outputs (the attention output,
  its log-sum-exp and the rest of what the kernel returns: ``KeptAttention``, a dispatch
  mode scoped to ``ops.varlen_attention``), and the offloader sends them to the host beside
  the part's input. The recomputation hands them back to the same kernel calls, in order,
  instead of running them. The backward's node is the one the recomputation makes, with
  these tensors: the same values, as the kernels are deterministic. That is about a fifth
  of a block's forward, for one more token row of model width per part on the host.
- **The part's tail** (``JointBlock.TAILS``): the linear whose output only the part's
  residual add reads. The add's gradient reads the gate, not that output, so when the gate
  needs no gradient (nothing but the part's input does) nothing in backward reads the
  output either. ``unevaluated`` leaves it uncomputed (zeros) while the layer's node saves
  what its backward needs: a folding LoRA on a plain linear (``kmoss_unevaluated``, read by
  ``kohakumoss.adapters.folded``) or a frozen plain linear. The block's output, garbage
  then, is only the root backward starts from. Any other layer runs as it is.

Gradients stay bit-identical to plain autograd's (``tests/test_offload.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from kohakumoss.model.engines import EngineRegistry, Handle
from kohakumoss.model.ops import OpEntry


def is_attention_kernel(func) -> bool:
    """An attention kernel's forward as the dispatcher sees it below autograd (torch's SDPA
    kernels, the varlen flash op, the custom ops of FA4's and TileLang's attention), not its
    backward (``..._backward``, ``..._bwd``) or the SDPA backend choice."""
    name = func._schema.name
    return ("attention" in name or "varlen_attn" in name) and "backward" not in name \
        and not name.endswith("_bwd") and "choice" not in name


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if is_attention_kernel(func):
            self.calls.append((func, out))
        return out


class _Replay(TorchDispatchMode):
    def __init__(self, calls: list[tuple]):
        super().__init__()
        self.calls = list(calls)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not is_attention_kernel(func):
            return func(*args, **(kwargs or {}))
        if not self.calls or self.calls[0][0] is not func:
            want = self.calls[0][0] if self.calls else "nothing"
            raise RuntimeError(f"activation offload's replay: the recomputation called {func}, "
                               f"its forward recorded {want} here")
        _, out = self.calls.pop(0)
        return out


# backends whose kernels a dispatch mode does not see as one op (flex is compiled): run as
# they are, and recomputed
UNSEEN = ("flex",)


def _dropped(_):
    return None


class KeptAttention:
    """``ops.varlen_attention`` whose kernels' outputs wait with the part's offloaded input
    (see the module): forward records them, the recomputation replays them."""

    def __init__(self, attention: OpEntry, offloader):
        self.attention, self.offloader = OpEntry.of(attention), offloader
        self.__qualname__ = f"kept({attention.label})"

    def __call__(self, q, k, v, lengths):
        part = self.offloader.part
        if part is None or (part[1] is None and self.attention.backend_for(q, k, v, lengths) in UNSEEN):
            return self.attention(q, k, v, lengths)  # (nothing recorded: the part recomputes it)
        index, kept = part
        if kept is None:  # forward (without grad): run as backward will need it, and record
            # the graph this builds never runs backward: it saves nothing (an outer pack hook,
            # weight streaming's, would hold the kernel's output and its node in a cycle)
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_dropped, _dropped), \
                    _Record() as rec:
                o = self.attention(*(t.detach().requires_grad_() for t in (q, k, v)), lengths)
            leaves, meta = [], []
            for func, out in rec.calls:
                flat, spec = tree_flatten(out)
                where = [isinstance(t, torch.Tensor) for t in flat]
                leaves += [t.detach() for t, w in zip(flat, where) if w]
                meta.append((func, spec, where, [None if w else t for t, w in zip(flat, where)]))
            self.offloader.add(index, leaves, meta)
            return o.detach()
        tensors, meta = kept.pop(0) if kept else ((), ())
        if not meta:  # forward recorded no kernel here (a backend this mode cannot see)
            return self.attention(q, k, v, lengths)
        it, calls = iter(tensors), []
        for func, spec, where, static in meta:
            calls.append((func, tree_unflatten([next(it) if w else s for w, s in zip(where, static)], spec)))
        with _Replay(calls) as rep:
            o = self.attention(q, k, v, lengths)
        if rep.calls:
            raise RuntimeError(f"activation offload's replay: {len(rep.calls)} recorded attention "
                               f"call(s) left over by the recomputation")
        return o


class _UnevaluatedLinear(torch.autograd.Function):
    """A frozen ``F.linear`` whose output nobody reads: zeros forward, the input gradient
    as autograd's own (``dy W``) backward."""

    @staticmethod
    def forward(ctx, x2, weight):
        ctx.save_for_backward(weight)
        return x2.new_zeros(x2.shape[0], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        (weight,) = ctx.saved_tensors
        return (dy.mm(weight) if ctx.needs_input_grad[0] else None), None


def _frozen_plain(module: nn.Module, engines: EngineRegistry) -> bool:
    """An ``nn.Linear`` whose call no engine claims (``EngineRegistry.claims``), frozen."""
    return (type(module) is nn.Linear and not engines.claims(module)
            and not module.weight.requires_grad
            and (module.bias is None or not module.bias.requires_grad))


@contextlib.contextmanager
def unevaluated(module: nn.Module | None, engines: EngineRegistry | None = None):
    """Within: ``module``'s output is left uncomputed where its backward allows (see the
    module); ``None``: nothing changes. ``engines``: the model's registry, which is told
    that the module's call is not plain meanwhile."""
    if module is None:
        yield
        return
    plain = _frozen_plain(module, engines)
    hold = contextlib.nullcontext()
    if plain:
        def forward(x):
            return _UnevaluatedLinear.apply(x.reshape(-1, x.shape[-1]), module.weight).view(
                *x.shape[:-1], module.out_features)
        module.forward = forward
        hold = engines.holding(Handle("unevaluated tail", linears=(module,)))
    module.kmoss_unevaluated = True
    try:
        with hold:
            yield
    finally:
        module.kmoss_unevaluated = False
        if plain:
            del module.forward
