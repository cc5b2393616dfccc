"""The memory estimator: a training step's predicted peak (torch allocator) for the params'
model, adapter, precision and memory engines, at a micro-batch's token counts, before any
weight is loaded (``docs/memory.md, "The estimator"``).

Nothing is guessed from tables: the transformer and its adapter are built on the meta
device (no storage), so parameter counts are the real ones, and one joint block and one
text block run forward there under ``saved_tensors_hooks`` at the micro-batch's true token
counts, so what autograd keeps per block is what the code keeps (each storage counted
once; the op table and its recomputation as a run applies them; attention as the fused
kernels keep it: q, k, v, the output and its log-sum-exp). The step's peak is then, at the
start of backward:

- weights as held (the frozen base in the compute dtype, or a full finetune's fp32
  masters), the trained tensors, their gradients and the optimizer's states;
- what the blocks keep under the checkpointing mode: everything (``none``), only each
  block's input (``block``), its two halves' inputs (``sub-block``), the input plus the
  matmul and attention outputs (``selective``), or ``block`` for the first k blocks;
- the backward's working set on top: the gradients of one block's widest intermediates
  (``WORKING_SET`` rows, calibrated on measured H200 steps); when blocks are checkpointed,
  one block recomputed (or half a block) and a smaller working set on top of it
  (``RECOMPUTED_WORKING_SET``); when weights stream, the side streams' buffers in flight.

``kohakumoss.training.autoprofile.resolve_profile`` picks a run's engines from these
estimates (``profile: auto``).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Sequence

import torch

from kohakumoss.config import Params, parallel_mode
from kohakumoss.quant import quant_plan
from kohakumoss.memory import apply_recompute
from kohakumoss.memory.profiles import MemoryEngines
from kohakumoss.memory.rebuild import apply_rebuild
from kohakumoss.memory.stepping import STATE_GROUP_NUMEL
from kohakumoss.model.config import DiTConfig
from kohakumoss.model.dit import REPEATED, MOSSImageTransformer, cast_model
from kohakumoss.precision import precision_policy
from kohakumoss.optimizers import refusal
from kohakumoss.optimizers import state_bytes as state_bytes_of

log = logging.getLogger(__name__)

GiB = 2**30
# the backward's working set, in units of one block's widest activation row (the MLP's
# up-gate output and two model-width rows) per token: gradients of the MLP half's
# intermediates, cuBLAS workspaces and allocator slack, calibrated on the H200 LoRA steps of
# docs/performance.md ("Memory profiles": 4200 to 16800 tokens, every profile).
# With nothing checkpointed it rides on everything kept; a recomputed block is freed as its
# backward walks it, so on top of it ("block") or of a recomputed half ("sub-block") less.
WORKING_SET = 6
RECOMPUTED_WORKING_SET = {"block": 0.25, "sub-block": 1.7}
# streamed steps: device buffers the side streams (weight slots, offloaded inputs, gradients
# leaving for the host) still hold until the copy stream has passed them: a constant and
# rows per token (fitted on `low` and `minimal`, 1 and 4 samples, H200: docs/performance.md,
# "Memory profiles")
SIDE_STREAM_BYTES = int(0.07 * 2**30)
SIDE_STREAM_ROWS = 0.5


@dataclasses.dataclass(frozen=True)
class Estimate:
    engines: MemoryEngines
    tokens: int  # joint tokens of the micro-batch
    weights: int  # bytes: the model's weights as held (frozen base, or fp32 masters)
    trained: int  # the adapter's tensors (fp32); 0 for a full finetune (they are the weights)
    gradients: int
    optimizer: int
    activations: int  # kept from forward to backward
    transient: int  # the backward's working set on top
    host: int = 0  # host memory the engines hold: streamed weights, masters, states, inputs

    @property
    def peak(self) -> int:
        return (self.weights + self.trained + self.gradients + self.optimizer + self.activations
                + self.transient)

    def describe(self) -> str:
        host = f"; {size(self.host)} of host memory for the engines" if self.host else ""
        return (f"{size(self.peak)} predicted peak ({self.engines.describe()}; {self.tokens} "
                f"tokens per micro-batch{host}): weights {size(self.weights)}, trained + gradients + "
                f"optimizer {size(self.trained + self.gradients + self.optimizer)}, activations "
                f"{size(self.activations)}, backward working set {size(self.transient)}")


def size(b: float) -> str:
    """``12.3 GiB``, ``45.6 MiB``, ``789 KiB``."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20)):
        if b >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{b / 1024:.0f} KiB"


def placed(engines: MemoryEngines, params: Params, device: torch.device) -> tuple[MemoryEngines, str]:
    """``engines`` as this run can place the weights and the optimizer, and a note when that
    differs: weight streaming, the host update and activation offload need a CUDA device
    (elsewhere host and device memory are one). Kept fp8 transposes are dropped, silently,
    where the run has none (no ``precision.fp8_compute: full`` on a frozen base)."""
    notes = []
    if engines.fp8_transposes and (not quant_plan(params.precision).keeps_transposes or params.adapter.full):
        engines = dataclasses.replace(engines, fp8_transposes=False)  # nothing to keep: no note
    if parallel_mode(params) == "threaded":  # each block lives on its device (parallel/split.py)
        off = [what for what, on in (("weight streaming", engines.stream_slots),
                                     ("activation offload", engines.offload),
                                     (f"the {engines.optimizer} optimizer", engines.optimizer in ("host", "streamed")))
               if on]
        if off:
            engines = dataclasses.replace(engines, stream_slots=0, resident_blocks=0, offload=False,
                                          optimizer="device" if engines.optimizer in ("host", "streamed")
                                          else engines.optimizer)
            notes.append(f"{', '.join(off)} off: parallel.mode threaded holds each joint block "
                         f"and its optimizer state on the device it is placed on")
    if engines.stream_slots and device.type != "cuda":
        why = f"it needs a CUDA device: on {device.type} the weights are in host memory already"
        engines = dataclasses.replace(engines, stream_slots=0, resident_blocks=0)
        notes.append(f"weight streaming is off ({why}); the base's weights stay where they are")
    if engines.optimizer == "host" and device.type != "cuda":
        engines = dataclasses.replace(engines, optimizer="device")
        notes.append(f"the host update is off (on {device.type} the optimizer runs on the host "
                     f"already)")
    if engines.optimizer == "streamed" and device.type != "cuda":
        engines = dataclasses.replace(engines, optimizer="device")
        notes.append(f"the streamed optimizer states are off (on {device.type} the states are "
                     f"in host memory already)")
    if engines.offload and device.type != "cuda":
        engines = dataclasses.replace(engines, offload=False)
        notes.append(f"activation offload is off (on {device.type} the activations are in host "
                     f"memory already)")
    why = refusal(params.optim.name, engines.optimizer)
    if why:  # a profile's placement this optimizer cannot take (a manual one is refused)
        notes.append(f"the {engines.optimizer} optimizer is off: optim.name {params.optim.name} "
                     f"runs on the device ({why})")
        engines = dataclasses.replace(engines, optimizer="device")
    return engines, "; ".join(notes)


class _FlashLike(torch.autograd.Function):
    """Attention as the fused kernels keep it for backward: q, k, v, the output and the
    per-head log-sum-exp (no score matrix). q and k are RoPE's outputs as given, so
    ``rebuild`` drops them for recipes (on the H200, per joint block at 16,800 tokens,
    ``speed`` keeps 2,080 MiB and ``balanced`` 1,424 MiB with the reference, Triton and
    compile tables alike; the 656 MiB between them include q and k: docs/performance.md)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, go):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _QuantLike(torch.autograd.Function):
    """A quantized linear as its kernels keep it for backward: nothing beyond the layer's own
    codes and scales (the reference would keep a dequantized weight per call)."""

    @staticmethod
    def forward(ctx, x, codes, scale, bias):
        ctx.x_shape = x.shape
        return x.new_empty(*x.shape[:-1], codes.shape[0])

    @staticmethod
    def backward(ctx, go):
        return go.new_empty(ctx.x_shape), None, None, None


class _Fp8LorasLike(torch.autograd.Function):
    """fp8 linears with their LoRAs as one node (``ops.fp8_lora_linears``) as its kernel
    keeps them: the input and the narrow product ``x A^T``."""

    @staticmethod
    def forward(ctx, x2, down, *tensors):
        h = x2.new_empty(x2.shape[0], down.shape[0])
        ctx.save_for_backward(x2, h)
        ctx.widths = [c.shape[0] for c in tensors]
        return tuple(x2.new_empty(x2.shape[0], w) for w in ctx.widths)

    @staticmethod
    def backward(ctx, *dys):
        x2, _ = ctx.saved_tensors
        return (torch.empty_like(x2), None, *([None] * len(ctx.widths)))


def _fp8_loras_like(x: torch.Tensor, layers, full: bool = False, narrow=None, held_t=None) -> list[torch.Tensor]:
    down = torch.cat([d for _, _, d, _ in layers])
    ys = _Fp8LorasLike.apply(x.reshape(-1, x.shape[-1]), down, *(c for c, _, _, _ in layers))
    return [y.view(*x.shape[:-1], y.shape[1]) for y in ys]


def _meta_model(params: Params, engines: MemoryEngines, config=None, device: str = "meta"
                ) -> tuple[MOSSImageTransformer, int, int, list[torch.Tensor]]:
    """The configured transformer on the meta device (or ``device``: tests) with the run's
    precision, recompute and trainable set: (model, frozen bytes, trained parameter count,
    the trained tensors by name)."""
    from kohakumoss.adapters import apply_adapters
    from kohakumoss.checks.params import transformer_config

    policy = precision_policy(params.train.dtype, full=params.adapter.full)
    with torch.device(device):
        model = MOSSImageTransformer(config or transformer_config(params))
    cast_model(model, policy.compute)  # a full finetune's autocast copies, in compute dtype
    if engines.recompute:
        apply_recompute(model)
    model.ops.override("varlen_attention", lambda q, k, v, lengths: _FlashLike.apply(q, k, v))
    quant = quant_plan(params.precision)
    if quant.quantized and not params.adapter.full:
        from kohakumoss.model.ops import OpTable
        from kohakumoss.quant.linear import quantize_base
        from kohakumoss.quant.ops import QUANT

        like = OpTable(QUANT)  # what the kernels keep, on meta
        for op in ("quant_linear", "fp8_linear"):
            like.override(op, _QuantLike.apply)
        like.override("fp8_lora_linears", _fp8_loras_like)
        quantize_base(model, quant.base, quant.compute, ops=like)
    apply_rebuild(model)  # counted apart (``_BlockBytes.rebuilt``), taken off with ``rebuild``
    if params.adapter.full:
        return model, 0, sum(p.numel() for p in model.parameters()), list(model.named_parameters())
    frozen = sum(t.numel() * t.element_size()  # held as computed (a quantized base: its codes)
                 for t in [*model.parameters(), *model.buffers()])
    try:
        adapters = apply_adapters(model, params.adapter, seed=params.run.seed)
    except Exception as e:  # an algorithm LyCORIS cannot build on meta (DoRA): LoRA's count
        log.debug("the estimator counts a LoRA of the same rank (%s on meta: %s)", params.adapter.algo, e)
        cfg = dataclasses.replace(params.adapter, algo="lora", dora=False)
        adapters = apply_adapters(model, cfg, seed=params.run.seed)
    tensors = list(adapters.named_trainable())
    return model, frozen, sum(p.numel() for _, p in tensors), tensors


@dataclasses.dataclass(frozen=True)
class _BlockBytes:
    kept: int  # everything autograd keeps for the block's backward
    inputs: int  # the block's input
    half_inputs: int  # the inputs of its halves (sub-block checkpointing)
    attention: int  # the attention's output (activation offload keeps it with the input)
    lse: int  # its log-sum-exp (kept on the device: small)
    selective: int  # the input plus the matmul and attention outputs
    rebuilt: int  # of ``kept``, the elementwise outputs ``rebuild`` does not keep
    row: int  # one token row of its widest intermediates (the MLP's, both halves' outputs)


def _block_bytes(block, args, mlp_width: int, shared: Sequence[torch.Tensor], rebuilder) -> _BlockBytes:
    """What autograd keeps for ``block(*args)`` on the meta device, each storage once; the
    weights and the ``shared`` inputs every block gets (RoPE angles, sample ids, modulation)
    are not the block's own and are left out."""
    storages: dict[int, int] = {}
    recipes: dict[int, int] = {}  # storages saved as a rebuild recipe
    weights = {t.untyped_storage()._cdata for t in [*block.parameters(), *block.buffers(), *shared]}

    def pack(t):
        s = t.untyped_storage()
        if s._cdata not in weights:  # the weights are counted once, as the model's
            (recipes if rebuilder.recipe(t) is not None else storages)[s._cdata] = s.nbytes()
        return t

    rebuilder.active = True
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(*args)
    finally:
        rebuilder.active = False
        rebuilder.made.clear()
    n, d = args[0].shape
    size = args[0].element_size()
    inputs = n * d * size
    out, lse = n * d * size, n * block.heads * 4  # attention's output and log-sum-exp
    # selective keeps each linear's output (an adapter's delta is added into it) and attention's
    linears = sum(m.out_features for m in block.modules() if isinstance(m, torch.nn.Linear))
    rebuilt = sum(b for s, b in recipes.items() if s not in storages)
    return _BlockBytes(kept=sum(storages.values()) + rebuilt, inputs=inputs, half_inputs=2 * inputs,
                       attention=out, lse=lse,
                       selective=inputs + n * linears * size + out + lse, rebuilt=rebuilt,
                       row=n * (2 * mlp_width + 2 * d) * size)


def _sizes(batch: Sequence[tuple[int, int]]) -> tuple[int, int, int]:
    img = sum(int(i) for i, _ in batch)
    txt = sum(int(t) for _, t in batch)
    return img + txt, txt, max(1, len(batch))


_BLOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> sizes -> blocks' bytes


def estimate(params: Params, batch: Sequence[tuple[int, int]], engines: MemoryEngines,
             config: DiTConfig | None = None, _model: tuple | None = None) -> Estimate:
    """The predicted peak of one training step on ``batch`` (each sample's ``(image tokens,
    text tokens)``) under ``engines``, for the params' transformer (or ``config``'s shape)."""
    model, frozen, trained_count, trained = _model or _meta_model(params, engines, config)
    adapter = [] if params.adapter.full else [t for _, t in trained]
    if engines.fp8_transposes and quant_plan(params.precision).keeps_transposes and not params.adapter.full:
        from kohakumoss.quant.linear import node_codes_bytes
        frozen += node_codes_bytes(model)  # memory.fp8_transposes: the codes' transposes kept
    c = model.config
    policy = precision_policy(params.train.dtype, full=params.adapter.full)
    cd = policy.compute
    n_joint, n_txt, B = _sizes(batch)
    size = torch.empty((), dtype=cd).element_size()

    angle = torch.promote_types(cd, torch.float32)
    shared_bytes = 0

    def run(block, n: int, joint: bool) -> _BlockBytes:
        # a joint block's input carries gradient from the blocks after the first; the text
        # refiner's only in a full finetune (else what it keeps is its own adapter's, if any)
        nonlocal shared_bytes
        x = torch.empty(n, c.dim, device="meta", dtype=cd, requires_grad=joint or params.adapter.full)
        rope = tuple(torch.empty(n, c.head_dim // 2, device="meta", dtype=angle) for _ in range(2))
        shared_bytes += 2 * n * (c.head_dim // 2) * angle.itemsize
        if joint:
            mod = torch.empty(B, 6, c.dim, device="meta", requires_grad=params.adapter.full)
            seg = torch.zeros(n, dtype=torch.long, device="meta")
            shared_bytes += n * 8 + (mod.numel() * 4 if params.adapter.full else 0)
            return _block_bytes(block, (x, mod, seg, rope, [n], model.ops), c.ffn_dim,
                                (*rope, mod, seg, *adapter), model.engines.state("rebuild"))
        return _block_bytes(block, (x, rope, [n], model.ops), c.ffn_dim, (*rope, *adapter),
                            model.engines.state("rebuild"))

    memo = _BLOCKS.setdefault(model, {})  # the same model and sizes: the same blocks' bytes
    key = (n_joint, n_txt, B, params.adapter.full, cd)
    if key not in memo:
        with torch.autocast("cpu", enabled=False):
            joint = run(model.layers[0], n_joint, True)
            text = run(model.text_embedder.blocks[0], n_txt, False) if c.text_blocks and n_txt else None
        memo[key] = joint, text, shared_bytes
    joint, text, shared_bytes = memo[key]
    lists = [(joint, c.depth)] + ([(text, c.text_blocks)] if text else [])
    mode, k = engines.checkpointing, engines.checkpoint_blocks
    kept = shared_bytes  # once for every block
    for b, count in lists:
        own = b.kept - (b.rebuilt if engines.rebuild else 0)  # a block not checkpointed
        if mode == "none":
            kept += count * own
        elif engines.offload and mode in ("block", "sub-block"):  # the inputs (and attention
            # outputs) around the part backward is in; every log-sum-exp
            kept += min(2, count) * b.inputs + count * b.lse + \
                (min(2, count) if mode == "block" else 1) * b.attention
        elif mode in ("block", "partial"):
            ckpt = count if mode == "block" else min(k, count)
            kept += ckpt * b.inputs + (count - ckpt) * own
        elif mode == "sub-block":
            kept += count * b.half_inputs
        elif mode == "selective":
            kept += count * min(b.selective, b.kept)
    # backward: the working set, plus what recomputing one checkpointed part adds on top of
    # what is kept then (blocks after it have been freed; partial recomputes only after
    # every non-checkpointed block is done)
    rows = WORKING_SET
    if mode == "block" or (mode == "partial" and k >= c.depth):  # every block recomputed
        extra, rows = joint.kept, RECOMPUTED_WORKING_SET["block"]
    elif mode == "sub-block":  # a recomputed half, within the MLP half's working set
        extra, rows = 0, RECOMPUTED_WORKING_SET["sub-block"]
    elif mode == "selective":
        extra = max(0, joint.kept - joint.selective)
    else:  # partial short of every block: a kept block's activations are freed before the
        extra = 0  # first recomputation starts, and one block's recomputation needs no more
    if engines.stream_slots:
        rows += SIDE_STREAM_ROWS
    transient = int(rows * joint.row) + extra + (SIDE_STREAM_BYTES if engines.stream_slots else 0)
    # the step's own tensors: latents, noise, target and prediction (fp32), the text states
    n_img = n_joint - n_txt
    kept += n_img * c.latent_channels * 4 * 4 + n_txt * c.text_dim * size
    master = 4  # fp32 masters, gradients and optimizer states
    streamed = 0  # a full finetune's parameters held in the compute dtype in the ring
    host = 0  # what the engines keep in host memory
    if engines.offload:  # every checkpointed part's input and attention output (compute dtype)
        for b, count in lists:
            host += count * ((b.half_inputs if mode == "sub-block" else b.inputs) + b.attention)
    if engines.stream_slots:
        # the streamed block weights are on the host; the device holds the slots
        from kohakumoss.memory.streaming import streamed_weights, unit_numel

        units = streamed_weights(model, trainable=params.adapter.full)
        units = units[engines.resident_blocks:]  # the first blocks' weights stay resident
        if any(units):
            slot_bytes = min(engines.stream_slots, len(units)) * max(
                unit_numel(u) * size for u in units if u)
            host += sum(unit_numel(u) * size for u in units)  # the host copies
            if params.adapter.full:
                streamed = sum(p.numel() for u in units for _, _, p in u)
                frozen = slot_bytes
            else:
                frozen += slot_bytes - sum(p.numel() * p.element_size() for u in units for _, _, p in u)
    resident = trained_count - streamed if params.adapter.full else trained_count
    # the optimizer's own figure over the trained tensors (and the EMA's fp32 copy); a streamed
    # full finetune's resident share of it
    all_states = state_bytes_of(params.optim.name, [(n, tuple(t.shape)) for n, t in trained],
                                REPEATED) + (trained_count * master if params.optim.ema else 0)
    states = all_states / max(1, trained_count * master)  # per trained value, in fp32 values
    grads, state_bytes = resident * master, int(all_states * resident / max(1, trained_count))
    widest = max((t.numel() for t in (model.parameters() if params.adapter.full else adapter)),
                 default=0)
    if engines.optimizer == "host":  # gradients, states and the EMA live on the host
        # masters, their gradients, the states, and the landing buffers (the gradients'
        # dtype: the compute dtype for a streamed full finetune's blocks, else fp32)
        host += trained_count * master * 2 + all_states + (trained_count - streamed) * master \
            + streamed * size
        grads, state_bytes = 0, 0
    elif engines.optimizer == "fused" and params.train.grad_accum == 1:
        grads = widest * master  # each gradient dropped once its tensor is updated
    elif engines.optimizer == "streamed":  # two groups' states at a time (one prefetched)
        host += state_bytes
        state_bytes = min(state_bytes, int(2 * max(widest, STATE_GROUP_NUMEL) * master * states))
    if params.adapter.full:
        # fp32 masters, and autocast's copy of each in the compute dtype, kept for backward;
        # streamed: the blocks' slots, the rest resident (its masters on the host)
        weights = resident * (master + size) + frozen if streamed else trained_count * (master + size)
        return Estimate(engines, n_joint, weights, 0, grads, state_bytes, kept, transient, host)
    return Estimate(engines, n_joint, frozen, trained_count * master, grads, state_bytes, kept,
                    transient, host)
