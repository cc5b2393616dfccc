"""The frozen base held quantized (``precision.base: int8 | fp8``, ``precision.fp8_compute``;
``docs/precision.md#quantized-bases``).

``quantize_base(model, base, fp8_compute, device)`` acts on a built model from outside: every
linear of the repeated blocks (the joint blocks and the text refiner's) becomes a
``QuantizedLinear`` holding ``codes`` [out, in] (int8 or float8_e4m3fn) and one float32
``scale`` per output row, about half the bytes of bf16. Its forward is the quantized base's
table's ``quant_linear`` (``quant.ops.QUANT``, one table the model's quantized linears
share, registered on the model as engine ``quantized base``: the Triton kernel widens the
codes tile by tile inside the matmul; no dequantized copy of the weight is made) or, with
``fp8_compute``, ``fp8_linear`` (fp8 GEMMs on sm89+, a bf16 input gradient); a LoRA on an
fp8 one runs with it as one node (``lora_op``: the table's ``fp8_lora_linears``).

Adapters train on top unchanged: a ``QuantizedLinear`` is an ``nn.Linear`` whose forward is
the quantized one, and LyCORIS's bypass adds its delta to that forward. Code that needs the
matrix itself (a weight-rebuilding forward such as DoRA's, the merged-weight maths) reads
``.weight``, the dequantized weight in the model's dtype, made on each read. Export does not
read the training model's base: it writes adapters against the original checkpoint.

ComfyUI's quantized files are used as they are when their format is the one asked for:
int8 codes (ConvRot included: the layer rotates its input by the same Hadamard groups, since
``x (codes s H)^T = (x H) (codes s)^T``) for ``int8``, float8_e4m3fn codes for ``fp8``; a
tensor-wise scale becomes one per row, exactly. Any other weight is quantized per row here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kohakumoss.model.dit import REPEATED
from kohakumoss.model.engines import Handle
from kohakumoss.model.ops import OpTable
from kohakumoss.precision.quant import QuantizedWeight, quantize_int8, rotate_groups
from kohakumoss.quant import backends  # noqa: F401  (the quantized ops' backends registered)
from kohakumoss.quant.ops import QUANT, dequantize_rows, fp8_rows
from kohakumoss.quant.plan import BASES

ENGINE = "quantized base"

CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def rotate_input(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` with each consecutive group of ``group`` features times the Hadamard matrix H
    (symmetric, so ``rotate_groups``' ``@ H^T`` is ``@ H``), in float32, rounded once to x's
    dtype: the input side of a ConvRot weight."""
    return rotate_groups(x.float().reshape(-1, x.shape[-1]), group).reshape(x.shape).to(x.dtype)


class QuantizedLinear(nn.Linear):
    """A frozen linear whose weight is ``codes * scale[:, None]`` (then ConvRot-rotated when
    ``group``); its forward runs the ``quant_linear`` / ``fp8_linear`` op of ``ops`` (the
    quantized base's table, shared by the model's quantized linears; default: the
    references)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype, ops: OpTable | None = None, group: int = 0,
                 fp8_compute: bool = False, fp8_grad: bool = False):
        nn.Module.__init__(self)  # not nn.Linear's: no weight parameter is made
        self.out_features, self.in_features = codes.shape
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale.float().reshape(-1).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.weight_dtype, self.group, self.fp8_compute = dtype, group, fp8_compute
        self.fp8_grad = fp8_compute and fp8_grad  # the input gradient as an fp8 GEMM too
        self.ops = ops if ops is not None else OpTable(QUANT)
        self.keep_transposes = False  # memory.fp8_transposes: node_transposes kept between steps
        self._held_t: tuple[tuple[torch.Tensor, ...], int, torch.Tensor] | None = None

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight in the model's dtype (a new tensor on each read)."""
        w = dequantize_rows(self.codes, self.scale, torch.float32)
        if self.group:
            w = rotate_groups(w, self.group)  # W = (codes s) H, H applied per group of columns
        return w.to(self.weight_dtype)

    def __setattr__(self, name: str, value) -> None:
        if name == "weight":
            raise AttributeError("this linear's weight is held quantized (precision.base); it "
                                 "cannot be replaced or merged into: run the adapter as a "
                                 "forward (bypass) or load the base with precision.base: keep")
        super().__setattr__(name, value)

    def _op(self) -> Callable:
        return self.ops.fp8_linear if self.fp8_compute else self.ops.quant_linear

    def lora_op(self) -> Callable | None:
        """The table's ``fp8_lora_linears`` where this layer runs fp8 compute without a bias or
        a rotation (a LoRA on it is then one node with it: ``adapters/folded.py``), else None."""
        if not self.fp8_compute or self.bias is not None or self.group:
            return None
        return self.ops.fp8_lora_linears

    @torch.no_grad()
    def hold_slots(self, width: int) -> None:
        """Hold the codes with ``width`` zero columns after each row: ``codes`` becomes the
        view of the first ``in_features`` columns of an [out, in + width] buffer, done once
        (a copy of this layer's codes). fp8 compute's ``full`` node then writes its LoRA's
        slot columns there each forward instead of copying the codes beside a new slot
        (``quant/triton_fp8.py``: ``slot_view``); every other reader sees the same codes."""
        c = self.codes
        if c.stride() == (self.in_features + width, 1):
            return
        wide = torch.zeros((self.out_features, self.in_features + width), dtype=torch.uint8,
                           device=c.device)
        wide[:, :self.in_features].copy_(c.view(torch.uint8))
        self._buffers["codes"] = wide.view(c.dtype)[:, :self.in_features]

    @torch.no_grad()
    def node_transposes(self, layers: list["QuantizedLinear"], width: int) -> torch.Tensor:
        """The codes' transposes of ``layers`` (this one first: the linears of one LoRA node)
        side by side, then ``width`` slot columns: [in, sum of out + width], the layout fp8
        compute's input-gradient GEMM reads (``quant/triton_fp8.py``: ``transposed_codes``).
        Made once and held by this layer (``memory.fp8_transposes``: the bytes of the codes
        again), so that each backward writes only the slot instead of transposing the codes."""
        codes = [m.codes for m in layers]
        held = self._held_t
        if held is None or held[1] != width or len(held[0]) != len(codes) or \
                any(a is not b for a, b in zip(held[0], codes)):  # other codes (moved, re-held)
            self._held_t = None  # the old one freed before the new one is made
            total = sum(m.out_features for m in layers)
            out = torch.zeros((self.in_features, total + width), dtype=torch.uint8, device=self.codes.device)
            col = 0
            for m in layers:
                out[:, col:col + m.out_features].copy_(m.codes.view(torch.uint8).t())
                col += m.out_features
            self._held_t = tuple(codes), width, out.view(self.codes.dtype)
        return self._held_t[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group:
            x = rotate_input(x, self.group)
        if self.fp8_grad:
            return self._op()(x, self.codes, self.scale, self.bias, True)
        return self._op()(x, self.codes, self.scale, self.bias)

    def _apply(self, fn, recurse=True):
        """Moves follow ``fn``; the codes and scales keep their dtypes (a ``.to(bf16)`` of the
        model would otherwise turn fp8 codes into bf16 and round the scales)."""
        kept = {k: self._buffers[k] for k in ("codes", "scale")}
        super()._apply(fn, recurse)
        for k, old in kept.items():
            if self._buffers[k].dtype != old.dtype:
                self._buffers[k] = old.to(device=self._buffers[k].device)
        return self

    def extra_repr(self) -> str:
        kind = str(self.codes.dtype).removeprefix("torch.")
        if self.fp8_compute:
            kind = "fp8 compute and input gradient" if self.fp8_grad else "fp8 compute"
        rot = f", convrot={self.group}" if self.group else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}{rot}"


def quantize_rows(w: torch.Tensor, base: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row codes and float32 scales [out] of ``w``: int8 ``amax / 127``, round to
    nearest; fp8 e4m3 ``amax / 448``."""
    if base == "int8":
        codes, scale, _ = quantize_int8(w)
        return codes, scale.reshape(-1)
    return fp8_rows(w)


def stored_rows(q: QuantizedWeight | None, base: str) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """A file's quantized weight as (codes, per-row scale, ConvRot group) when its format is
    ``base``'s, else None."""
    if q is None or q.codes.dtype != CODE_DTYPES[base] or q.codes.dim() != 2:
        return None
    rows = q.codes.shape[0]
    s = q.scale.float().reshape(-1)
    if s.numel() not in (1, rows):
        return None
    s, codes = s.expand(rows).contiguous() if s.numel() == 1 else s, q.codes
    if (s < 0).any():  # not as stored: quantized again from the loaded weight
        return None
    if not (s > 0).all():  # a zero scale (a row of zeros) as scale 1 over zero codes: the same
        zero = s == 0      # weight, every scale positive (fp8_lora_linears divides by them)
        codes = codes.clone()
        codes.view(torch.uint8)[zero] = 0
        s = torch.where(zero, 1.0, s)
    return codes, s, q.convrot_group


def quantizable(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The linears a quantized base holds quantized: every ``nn.Linear`` of the repeated
    blocks (the embedders, the head and the conditioning stay in the model's dtype)."""
    return [(f"{path}.{i}.{name}", m) for path in REPEATED
            for i, block in enumerate(model.get_submodule(path))
            for name, m in block.named_modules() if type(m) is nn.Linear]


@torch.no_grad()
def quantize_base(model: nn.Module, base: str, fp8_compute: bool = False,
                  device: torch.device | str | None = None,
                  stored: Callable[[str], QuantizedWeight | None] | None = None,
                  fp8_grad: bool = False, ops: OpTable | None = None) -> str:
    """Replace ``quantizable(model)`` by ``QuantizedLinear``s (see the module); each weight is
    quantized on ``device`` (default: where it is) and its codes stay there. ``stored``: a
    checkpoint's quantized form of a weight, by state-dict name (a ComfyUI file's codes).
    ``fp8_grad`` (with ``fp8_compute``): the input gradients as fp8 GEMMs too. ``ops``: the
    table of ``QUANT`` the linears share (default: the references), registered on
    ``model.engines`` as ``quantized base`` (``quantized_ops(model)``). Returns a one-line
    account."""
    if base not in CODE_DTYPES:
        raise ValueError(f"precision.base {base!r}: one of {', '.join(BASES)}")
    if fp8_compute and base != "fp8":
        raise ValueError("fp8 compute runs on fp8 weights: set precision.base: fp8")
    layers = quantizable(model)
    ops = ops if ops is not None else OpTable(QUANT)
    before = after = kept = 0
    for path, lin in layers:
        w = lin.weight
        dev = torch.device(device) if device is not None else w.device
        got = stored_rows(stored(f"{path}.weight"), base) if stored is not None else None
        if got is not None:
            codes, scale, group = got
            kept += 1
        else:
            (codes, scale), group = quantize_rows(w.detach().to(dev), base), 0
        bias = None if lin.bias is None else lin.bias.to(dev)
        q = QuantizedLinear(codes.to(dev), scale.to(dev), bias, w.dtype, ops, group, fp8_compute,
                            fp8_grad)
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent), name, q)
        before += w.numel() * w.element_size()
        after += q.codes.numel() * q.codes.element_size() + q.scale.numel() * 4
    model.engines.register(Handle(ENGINE, state=ops))
    how = f"fp8 compute (e4m3 GEMMs{', input gradients too' if fp8_grad else ''})" if fp8_compute \
        else f"{base} weight-only"
    src = f", {kept} taken from the checkpoint as stored" if kept else ""
    return (f"{how}: {len(layers)} block linears in {after / 2**30:.2f} GiB "
            f"(was {before / 2**30:.2f} GiB){src}")


def quantized_ops(model: nn.Module) -> OpTable:
    """The table the quantized linears of ``model`` share (``quantize_base``)."""
    ops = model.engines.state(ENGINE)
    if ops is None:
        raise ValueError("the model's base is not held quantized (precision.base: keep)")
    return ops


def node_codes_bytes(model: nn.Module) -> int:
    """Bytes of the codes of every linear that runs its LoRA as one fp8 node (``lora_op``):
    what ``keep_fp8_transposes`` holds again."""
    return sum(m.codes.numel() * m.codes.element_size() for m in model.modules()
               if isinstance(m, QuantizedLinear) and m.lora_op() is not None)


def keep_fp8_transposes(model: nn.Module) -> int:
    """``memory.fp8_transposes``: every fp8-compute linear of ``model`` whose LoRA runs with it
    as one node (``lora_op``: no bias, no rotation) keeps that node's codes' transposes between
    steps (``QuantizedLinear.node_transposes``, made on the first forward); returns how many
    linears were set."""
    layers = [m for m in model.modules()
              if isinstance(m, QuantizedLinear) and m.fp8_grad and m.lora_op() is not None]
    for m in layers:
        m.keep_transposes = True
    return len(layers)
