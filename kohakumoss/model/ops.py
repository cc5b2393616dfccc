"""The op table: every numerically interesting op of the DiT forward, with its reference
(the training loss is the objective's: ``kohakumoss.diffusion.objective.OBJECTIVE``).

The model calls ``ops.<name>(...)`` on its own table and never chooses a backend itself;
the kernel registry (``kohakumoss.kernels``, ``docs/engines.md``) builds a table per model
from backends that must match these references, and engines (recomputation) wrap entries of
that model's table from outside. Each reference computes in ``max(float32, input dtype)``
and rounds once to the input dtype, as the reference implementation does (``docs/model.md``).

The quantized base's ops (``quant_linear``, ``fp8_linear``, ``fp8_lora_linears``) are a
contract of their own, ``kohakumoss.quant.ops.QUANT``.

Legend: N tokens, B samples, H heads, Dh head dim, D width; ``seg`` [N] int64 sample id of
each token; per-sample modulation vectors ``shift``/``scale``/``gate`` are float32 [B, D].
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import is_in_torch_dispatch_mode



def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(torch.float32, dtype)


def _up(t: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
    """``t`` in the compute dtype ``cd`` as one node of the autograd graph (a view when it is
    in ``cd`` already). An input used twice inside an op then gets its gradient summed inside
    the op, before it meets the rest of the graph, in every dtype (as a cast does): so a
    recomputed op (``kohakumoss.memory``) has plain autograd's gradients bit for bit."""
    return t.to(cd) if t.dtype != cd else t.view_as(t)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * w`` over the last dim (no ``1 +`` on the weight)."""
    return _rms(_up(x, compute_dtype(x.dtype)), weight, eps).to(x.dtype)


def modulated_rms_norm(x_ND: torch.Tensor, weight: torch.Tensor, shift_BD: torch.Tensor,
                       scale_BD: torch.Tensor, seg_N: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm(x) * (1 + scale) + shift`` with the token's sample's vectors."""
    cd = compute_dtype(x_ND.dtype)
    y = _rms(_up(x_ND, cd), weight, eps)
    return (y * (1 + _up(scale_BD, cd)[seg_N]) + _up(shift_BD, cd)[seg_N]).to(x_ND.dtype)


def rope_angles(pos_N4: torch.Tensor, bands: torch.Tensor, axes: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, Dh/2] in ``max(fp32, dtype)``: slot j uses axis j // NB, band j % NB."""
    cd = compute_dtype(dtype)
    nb = bands.numel()
    j = torch.arange(axes * nb, device=pos_N4.device)
    theta = pos_N4.to(cd)[:, j // nb] * bands.to(cd)[j % nb]
    return theta.cos(), theta.sin()


def qk_norm_rope(x_NHd: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """Per-head RMSNorm with the shared [Dh] weight, then split-half (NeoX) rotation."""
    cd = compute_dtype(x_NHd.dtype)
    y = _rms(_up(x_NHd, cd), weight, eps)
    half = y.shape[-1] // 2
    y1, y2 = y[..., :half], y[..., half:]
    c, s = _up(cos, cd)[:, None, :], _up(sin, cd)[:, None, :]
    return torch.cat([y1 * c - y2 * s, y2 * c + y1 * s], dim=-1).to(x_NHd.dtype)


def situ(u: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``(4 tanh(g/4) sigmoid(g)) * (25 tanh(u/25))``."""
    cd = compute_dtype(u.dtype)
    uf, gf = _up(u, cd), _up(g, cd)
    return ((4 * torch.tanh(gf / 4) * torch.sigmoid(gf)) * (25 * torch.tanh(uf / 25))).to(u.dtype)


def residual(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    cd = compute_dtype(x.dtype)
    return (_up(x, cd) + _up(y, cd)).to(x.dtype)


def gated_residual(x_ND: torch.Tensor, y_ND: torch.Tensor, gate_BD: torch.Tensor,
                   seg_N: torch.Tensor) -> torch.Tensor:
    """``x + gate * y`` with the token's sample's gate, added in fp32, rounded once."""
    cd = compute_dtype(x_ND.dtype)
    return (_up(x_ND, cd) + _up(gate_BD, cd)[seg_N] * _up(y_ND, cd)).to(x_ND.dtype)


FORMS = ("stream", "added")
"""The other forms a table entry may carry (``OpEntry.forms``; ``stream_norm``,
``added_norm``): each takes the op's own arguments first; None, or no form, runs the plain
calls."""


@dataclasses.dataclass(frozen=True, eq=False)
class OpEntry:
    """One entry of a model's op table: a typed record that wrappers compose without losing
    fields (``wrap``).

    - ``fn``: the call, with the reference's signature and results;
    - ``label``: what it is (``recomputed(tuned(situ: compile, reference))``), for logs;
    - ``forms``: its other forms (``FORMS``), each a callable on the op's arguments first,
      returning None where it declines the call;
    - ``keeps``: what its autograd keeps for backward: True when only the op's inputs, for
      every call (a fused backward recomputes the rest); False; or a per-call answer
      ``keeps(*args) -> bool`` (a tuned op: the backend it picks for that shape);
    - ``chooser``: ``chooser(*args) -> backend name`` where a kernel table picks per call
      (None: the entry is what runs);
    - ``by``, ``wraps``: the engine that wrapped an inner entry, and that entry.
    """

    fn: Callable
    label: str
    forms: Mapping[str, Callable] = dataclasses.field(default_factory=dict)
    keeps: bool | Callable[..., bool] = False
    chooser: Callable[..., str] | None = None
    by: str | None = None
    wraps: "OpEntry | None" = None

    def __post_init__(self):
        unknown = set(self.forms) - set(FORMS)
        if unknown:
            raise ValueError(f"{self.label}: unknown forms {sorted(unknown)}; forms: {', '.join(FORMS)}")
        object.__setattr__(self, "forms", MappingProxyType(dict(self.forms)))

    @classmethod
    def of(cls, fn: "Callable | OpEntry") -> "OpEntry":
        """``fn`` as an entry (an entry as it is; a plain callable with no forms, keeping what
        autograd keeps)."""
        return fn if isinstance(fn, OpEntry) else cls(fn, getattr(fn, "__qualname__", repr(fn)))

    def __call__(self, *args):
        return self.fn(*args)

    def __deepcopy__(self, memo) -> "OpEntry":  # an immutable record: a model's copy shares it
        return self

    @property
    def keeps_inputs_only(self) -> bool:
        """Whether every call keeps only the op's inputs for backward."""
        return self.keeps is True

    def keeps_inputs_only_for(self, *args) -> bool:
        """Whether this call keeps only the op's inputs for backward."""
        return self.keeps is True or (callable(self.keeps) and bool(self.keeps(*args)))

    def backend_for(self, *args) -> str | None:
        """The backend a call with these arguments runs (None where the table does not
        choose: the entry itself runs)."""
        return self.chooser(*args) if self.chooser is not None else None

    def form(self, name: str) -> Callable | None:
        return self.forms.get(name)

    def wrap(self, fn: Callable, by: str, **changes) -> "OpEntry":
        """A new entry calling ``fn`` (which calls this one) for engine ``by``, with every
        other field of this one unless ``changes`` says otherwise."""
        return dataclasses.replace(self, **{"fn": fn, "label": f"{by}({self.label})", "by": by,
                                            "wraps": self, **changes})

    def wrapped_by(self, by: str) -> bool:
        """Whether engine ``by`` wrapped this entry or one inside it."""
        entry = self
        while entry is not None:
            if entry.by == by:
                return True
            entry = entry.wraps
        return False


def _form(fn: Callable, name: str) -> Callable | None:
    return fn.form(name) if isinstance(fn, OpEntry) else None


def stream_norm(norm: Callable, x_ND: torch.Tensor, weight: torch.Tensor, shift_BD: torch.Tensor,
                scale_BD: torch.Tensor, seg_N: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x, ...), x)``: a block half's modulated norm of the residual stream ``x`` (``norm``
    a table's ``modulated_rms_norm``), and ``x`` for the add that closes the half. Where the
    call runs a backend with a ``stream`` form (the Triton kernels': its backward adds the
    closing add's gradient of x to the norm's own in one pass, where autograd would sum them in
    a pass of its own), x comes back through that node (``norm.form("stream")``: None where
    there is none, or where it declines the call); else x itself."""
    args = (x_ND, weight, shift_BD, scale_BD, seg_N, eps)
    stream = _form(norm, "stream")
    out = stream(*args) if stream is not None else None
    return out if out is not None else (norm(*args), x_ND)


def added_norm(norm: Callable, add: Callable, x_ND: torch.Tensor, y_ND: torch.Tensor,
               gate_BD: torch.Tensor, weight: torch.Tensor, shift_BD: torch.Tensor,
               scale_BD: torch.Tensor, seg_N: torch.Tensor, eps: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(s, ...), s)`` with ``s = add(x, y, gate, seg)``: the gated add that closes a
    block's half and the modulated norm that opens the next (``norm``, ``add``: a table's
    ``modulated_rms_norm`` and ``gated_residual``). Where the norm's call runs a backend with
    an ``added`` form (the Triton kernels': one pass that writes s and reads it once, and one
    for its gradients), that form; else the add, then the norm through ``stream_norm``."""
    form = _form(norm, "added")
    out = None if form is None else form(x_ND, weight, shift_BD, scale_BD, seg_N, eps, y_ND, gate_BD)
    if out is not None:
        return out
    return stream_norm(norm, add(x_ND, y_ND, gate_BD, seg_N), weight, shift_BD, scale_BD, seg_N, eps)


def varlen_attention(q_NHd: torch.Tensor, k_NHd: torch.Tensor, v_NHd: torch.Tensor,
                     lengths: list[int]) -> torch.Tensor:
    """Softmax attention within each contiguous segment of ``lengths`` tokens. Each input is
    split once (not sliced per segment): its gradient is then one ``cat`` of the segments'
    gradients, where slices would each write a zero-filled full-size tensor and add them.
    The batch dim goes by ``squeeze``, not ``[0]``: a select's backward writes a zero-filled
    tensor and copies the gradient into it, where a squeeze's is a view."""
    scale = 1.0 / math.sqrt(q_NHd.shape[-1])
    lengths = [int(n) for n in lengths]
    out = []
    for q, k, v in zip(*(t.split(lengths) for t in (q_NHd, k_NHd, v_NHd))):
        if q.shape[0]:
            q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            out.append(F.scaled_dot_product_attention(q, k, v, scale=scale).squeeze(0).transpose(0, 1))
    return torch.cat(out) if out else q_NHd.new_zeros(q_NHd.shape)


def timestep_embedding(t_B: torch.Tensor, dim: int) -> torch.Tensor:
    """``[cos | sin](t * 10000^(-k/half))`` in float32, cos first."""
    half = dim // 2
    omega = torch.pow(10000.0, -torch.arange(half, dtype=torch.float32, device=t_B.device) / half)
    angles = t_B.float()[:, None] * omega[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def linear(x: torch.Tensor, weight: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` (a bias-free block linear's product; weight [O, K], a transposed
    view taken as it is), ``+ acc`` when given. ``acc`` may be overwritten (a LoRA node's
    temporary: the product accumulates onto it, as ``addmm_``); never one autograd tracks."""
    if acc is None:
        return F.linear(x, weight)
    x2 = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and acc.requires_grad or is_in_torch_dispatch_mode():
        return torch.addmm(acc, x2, weight.t())
    return acc.addmm_(x2, weight.t())


def linears(x: torch.Tensor, modules, linear: Callable = linear,
            plain: Callable[[torch.nn.Module], bool] = lambda m: False) -> list[torch.Tensor]:
    """The linears ``modules`` that read one input, each on ``x``: a plain one (``plain``:
    the model's ``engines.plain_linear``, the one rule) through ``linear`` (the caller's
    table's ``ops.linear``), any other through its own call. An adapter may put one node for
    the group in a model's table (``kohakumoss/adapters/shared.py``)."""
    return [linear(x, m.weight) if plain(m) else m(x) for m in modules]


REFERENCE: dict[str, Callable] = {
    "rms_norm": rms_norm,
    "modulated_rms_norm": modulated_rms_norm,
    "rope_angles": rope_angles,
    "qk_norm_rope": qk_norm_rope,
    "situ": situ,
    "residual": residual,
    "gated_residual": gated_residual,
    "varlen_attention": varlen_attention,
    "timestep_embedding": timestep_embedding,
    "linear": linear,
    "linears": linears,
}


class OpTable:
    """Name -> ``OpEntry``; starts as the references, backends and engines override entries.

    Every model holds its own table (``MOSSImageTransformer(config).ops``): overriding an op
    of one model never changes another's. ``table.<name>`` is the entry (called as the op);
    ``override`` takes an entry, or a plain callable (an entry with no forms).
    """

    __slots__ = ("_ops",)

    def __init__(self, ops: Mapping[str, Callable] | None = None):
        self._ops = {k: OpEntry.of(v) for k, v in (REFERENCE if ops is None else ops).items()}

    def __getattr__(self, name: str) -> OpEntry:  # called only for the op names
        try:
            return object.__getattribute__(self, "_ops")[name]
        except KeyError:
            raise AttributeError(f"op {name!r} is not in the op table") from None

    def override(self, name: str, fn: Callable | OpEntry) -> None:
        if name not in self._ops:
            raise KeyError(f"unknown op {name!r}; ops: {', '.join(self._ops)}")
        self._ops[name] = OpEntry.of(fn)

    def names(self) -> dict[str, str]:
        return {k: v.label for k, v in self._ops.items()}

    def __repr__(self) -> str:
        return f"OpTable({self.names()})"
