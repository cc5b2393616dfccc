"""Problem shapes: what size of work an op call is, bucketed so a tuning table stays small.

For each tunable op of the op table (``kohakumoss.model.ops``) a ``Problem`` says:

- ``dims(*args)``: the call's shape as named sizes, e.g. ``{"N": 16200, "D": 3072}``;
- ``keyed``: the sizes that pick a table entry; token counts (``N``, the longest segment
  ``L``) are rounded up to a bucket (``bucket``), model sizes (D, F, H, Dh) are exact;
- ``make(dims, dtype, device, generator, weights_grad)``: inputs of that shape for the
  tuner to time; activations take a gradient, the op's parameters (norm weights, per-sample
  shift / scale / gate) only with ``weights_grad`` (a full finetune: an adapter run's
  frozen base gives them none).

``plan_problems(config, batches)`` lists the shapes a plan's batches give each op of the
MOSS-Image DiT (``kohakumoss.model.dit``), as recorded from the model's own forward on the
meta device (``call_structure``: text blocks over the text tokens, joint blocks over image +
text tokens, the final norm over the image tokens, the loss); ``plan_calls`` how many calls
the run makes in each shape bucket (what a backend's build is weighed against). An op with no
``Problem`` is not tuned (its backend is chosen statically, or it is the reference).

Legend: N tokens, B samples, D width, F ffn width, K x O a linear's input x output width, H
heads, Dh head dim, S segments,
L longest segment.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from kohakumoss.model.config import DiTConfig
from kohakumoss.model.ops import OpEntry, compute_dtype

Dims = dict[str, int]
MIN_BUCKET = 16


def bucket(n: int) -> int:
    """The smallest of 16, 24, 32, 48, 64, 96, ... (2^k and 1.5 * 2^k) that is >= ``n``:
    at most 1.5x apart, so a table holds a few entries per op for a whole plan."""
    b = MIN_BUCKET
    while True:
        for size in (b, b * 3 // 2):
            if size >= n:
                return size
        b *= 2


@dataclasses.dataclass(frozen=True)
class Problem:
    op: str
    dims: Callable[..., Dims]
    keyed: tuple[str, ...]
    make: Callable[[Mapping[str, int], torch.dtype, torch.device, torch.Generator, bool], tuple]
    tokens: tuple[str, ...] = ("N",)  # keyed sizes that are bucketed

    def key(self, dims: Mapping[str, int]) -> str:
        """The table key of a shape: ``N=16384,D=3072`` (token sizes bucketed)."""
        return ",".join(f"{k}={bucket(dims[k]) if k in self.tokens else dims[k]}"
                        for k in self.keyed)


def register_problem(problem: Problem) -> Problem:
    """Tune ``problem.op`` by these shapes (an op a package above registers: ``quant/``)."""
    if problem.op in PROBLEMS:
        raise ValueError(f"op {problem.op!r} has its problem shapes already")
    PROBLEMS[problem.op] = problem
    return problem


def rand(g: torch.Generator, device, dtype, *shape: int, grad: bool = True) -> torch.Tensor:
    """Standard normal values drawn by ``g`` (a generator on ``device``), in ``dtype``."""
    t = torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)
    return t.requires_grad_(grad)


def segments(n: int, b: int, device) -> torch.Tensor:
    """Sample ids of ``n`` tokens in ``b`` near-equal contiguous samples."""
    b = max(1, min(b, n))
    return (torch.arange(n) * b // max(n, 1)).to(device)


def lengths_of(n: int, longest: int) -> list[int]:
    """``n`` tokens as segments of ``longest`` tokens and a remainder."""
    longest = max(1, min(longest, n))
    return [longest] * (n // longest) + ([n % longest] if n % longest else [])


def rows(x: torch.Tensor) -> int:
    return x.numel() // max(x.shape[-1], 1)


PROBLEMS: dict[str, Problem] = {}
"""op -> its problem shapes: each op's folder (``kernels/norm/``, ...) registers its own
(``register_problem``), in the order ``kohakumoss.kernels`` imports them."""



def call_dtype(args: Sequence) -> torch.dtype:
    """The dtype a call computes in: that of its first tensor argument."""
    return next(a.dtype for a in args if isinstance(a, torch.Tensor))


def batch_quantities(samples: Sequence[tuple[int, int]]) -> Dims:
    """The sizes a batch's op calls are made of (``samples``: each sample's ``(image_tokens,
    text_tokens)``): image, text and joint tokens, samples, and the text's and the joint
    stream's longest segment and segment count (every sample has a joint segment)."""
    img = [int(i) for i, _ in samples]
    txt = [int(t) for _, t in samples]
    joint = [i + t for i, t in zip(img, txt)]
    return {"n_img": sum(img), "n_txt": sum(txt), "n_joint": sum(joint), "B": len(samples),
            "L_txt": max(txt, default=0), "S_txt": sum(1 for t in txt if t),
            "L_joint": max(joint, default=0)}


# two batches whose quantities differ from each other's and from every model size, so each
# size of a recorded call is found to be one quantity, or a constant (a model size)
PROBES = ([(101, 0), (211, 13), (307, 29)], [(103, 0), (223, 17), (331, 37), (449, 41)])


def _meta_calls(config: DiTConfig, samples: Sequence[tuple[int, int]]) -> list[tuple[str, Dims]]:
    """The tunable op calls of one training use of ``samples`` in call order, recorded from
    the DiT's forward on the meta device (no memory, no arithmetic) through a counting table,
    and the loss the trainer computes on its output."""
    from kohakumoss.diffusion.objective import OBJECTIVE
    from kohakumoss.model.dit import MOSSImageTransformer
    from kohakumoss.model.layout import build_layout
    from kohakumoss.model.ops import REFERENCE, OpTable

    with torch.device("meta"):
        model = MOSSImageTransformer(config)
    objective = OpTable(OBJECTIVE)
    calls: list[tuple[str, Dims]] = []

    def recording(op: str, entry: OpEntry) -> OpEntry:
        def call(*args):
            calls.append((op, PROBLEMS[op].dims(*args)))
            return entry.fn(*args)
        return entry.wrap(call, "recorded")

    for op in PROBLEMS:  # the ops of the DiT's and the objective's tables (a quantized
        table = objective if op in OBJECTIVE else model.ops  # base's are not recorded here)
        if op in OBJECTIVE or op in REFERENCE:
            table.override(op, recording(op, getattr(table, op)))
    layout = build_layout([(1, i) for i, _ in samples], [t for _, t in samples]).to("meta")
    meta = dict(device="meta")
    with torch.no_grad():
        v = model(torch.empty(layout.n_img, config.latent_channels, **meta),
                  torch.empty(layout.n_txt, config.text_dim, **meta),
                  torch.empty(len(samples), **meta), layout)
        objective.flow_loss(v, v, layout.seg_img, torch.empty(len(samples), **meta), layout.n_img,
                            "mse", 1.0)
    return calls


Structure = tuple[tuple[str, tuple[tuple[str, str | None, int], ...], int], ...]


@functools.lru_cache(maxsize=16)
def call_structure(config: DiTConfig) -> Structure:
    """``(op, sizes, calls)`` of one training use of any batch, each size ``(name, quantity,
    value)``: a ``batch_quantities`` name, or None and the constant model size. Recorded once
    per model config from two meta forwards (``PROBES``): the same calls, each size either
    the same in both (a model size) or the quantity it equals in both."""
    (a, b), (qa, qb) = (_meta_calls(config, p) for p in PROBES), (batch_quantities(p) for p in PROBES)
    if [op for op, _ in a] != [op for op, _ in b]:
        raise RuntimeError("the DiT's op calls depend on the batch beyond its sizes: the probes' "
                           "forwards call different ops")
    counted: Counter = Counter()
    for (op, da), (_, db) in zip(a, b):
        sizes = []
        for k in da:
            if da[k] == db[k]:
                sizes.append((k, None, da[k]))
                continue
            names = [q for q in qa if qa[q] == da[k] and qb[q] == db[k]]
            if not names:
                raise RuntimeError(f"{op}'s size {k} ({da[k]}, {db[k]}) is none of a batch's "
                                   f"quantities ({', '.join(qa)}): add it to batch_quantities")
            sizes.append((k, names[0], 0))
        counted[(op, tuple(sizes))] += 1
    return tuple((op, sizes, n) for (op, sizes), n in counted.items())


def batch_calls(config: DiTConfig, samples: Sequence[tuple[int, int]]) -> list[tuple[str, Dims, int]]:
    """The op calls one training use of a batch makes (``samples``: each sample's
    ``(image_tokens, text_tokens)``), as ``(op, dims, calls)``: the recorded structure of the
    DiT's own forward (``call_structure``) at the batch's sizes; a call on no tokens (the text
    ops of a batch without text) is none."""
    if not samples:
        return []
    q = batch_quantities(samples)
    out = []
    for op, sizes, n in call_structure(config):
        dims = {k: q[name] if name is not None else value for k, name, value in sizes}
        if all(q[name] for _, name, _ in sizes if name is not None):
            out.append((op, dims, n))
    return out


def plan_problems(config: DiTConfig, batches: Iterable[Sequence[tuple[int, int]]]
                  ) -> dict[str, dict[str, Dims]]:
    """``{op: {key: dims}}``: the shapes each op sees over ``batches`` (per batch, each
    sample's ``(image_tokens, text_tokens)``); per key, the dims of its largest batch."""
    out: dict[str, dict[str, Dims]] = {op: {} for op in PROBLEMS}
    for samples in batches:
        for op, dims, _ in batch_calls(config, samples):
            key = PROBLEMS[op].key(dims)
            held = out[op].get(key)
            if held is None or dims["N"] > held["N"]:
                out[op][key] = dims
    return {op: shapes for op, shapes in out.items() if shapes}


def plan_calls(config: DiTConfig, batches: Iterable[Sequence[tuple[int, int]]]
               ) -> dict[str, dict[str, int]]:
    """``{op: {key: calls}}``: how many times a run over ``batches`` calls each op in each
    shape bucket (forward and backward counting as one use, as the tuner times them)."""
    out: dict[str, dict[str, int]] = {}
    for samples in batches:
        for op, dims, calls in batch_calls(config, samples):
            key = PROBLEMS[op].key(dims)
            out.setdefault(op, {})[key] = out.get(op, {}).get(key, 0) + calls
    return out
