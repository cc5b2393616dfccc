"""A persistent GEMM for Hopper (sm90+) in Triton, behind the ``triton`` backend of
``ops.linear``: ``C = A B^T`` (the forward, B the weight [N, K]) or ``C = A B`` (the input
gradient, B the weight [K, N]), optionally accumulated onto C (``C += ...``: the LoRA node's
base product lands on the adapter's output). Operands and the output move by the Tensor
Memory Accelerator (host-side descriptors), the products run on ``wgmma`` with fp32
accumulation, and each output tile is rounded once. One program per multiprocessor walks
the output tiles in groups of ``GROUP_M`` row tiles, so the weight tiles a group shares stay
in L2.

Why it exists: cuBLAS runs every block linear through one kernel (256 x 152 tiles). At the
sampler's 8.4k tokens the 3072-wide q, k, v and o products run at ~490 TFLOP/s there, against
~640 here (``docs/performance.md``); the tuner (``ops.linear``'s problem) picks per shape.

Interpreted (``TRITON_INTERPRET=1``) the same kernel runs on CPU tensors at tiny sizes
(tests, CI). Importing this module imports Triton.

Legend: M rows (tokens), K the summed dimension, N output columns, BM x BN x BK a tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kohakumoss.kernels.triton_common import INTERPRETED, jit, rounded

# (BM, BN, BK, stages, warps): the H200 sweep's two best at the DiT's shapes (128 x 256 wins
# at 16.8k tokens, 256 x 128 at 8.4k x 3072 x 3072); ``config`` picks by the tile count
CONFIGS = ((128, 256, 64, 3, 8), (256, 128, 64, 3, 8))
SMALL_CONFIG = (64, 128, 64, 3, 4)  # where a big one does not fit shared memory (odd sizes)
INTERPRETED_CONFIG = (16, 16, 16, 1, 4)
GROUP_M = 8
_SMS: dict[int, int] = {}
_TORCH_DTYPES = (torch.bfloat16, torch.float16)
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@jit
def _gemm(a_desc, b_desc, c_desc, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
          GROUP: tl.constexpr, PROGRAMS: tl.constexpr, B_KMAJOR: tl.constexpr,
          ACCUMULATE: tl.constexpr, STAGES: tl.constexpr, OUT: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    per_group = GROUP * tiles_n
    for tile in tl.range(pid, tiles_m * tiles_n, PROGRAMS, flatten=True, num_stages=STAGES):
        first_m = (tile // per_group) * GROUP
        rows = tl.minimum(tiles_m - first_m, GROUP)
        tm = first_m + (tile % per_group) % rows
        tn = (tile % per_group) // rows
        acc = tl.zeros((BM, BN), tl.float32)
        for kt in range(k_tiles):
            a = a_desc.load([tm * BM, kt * BK])
            if B_KMAJOR:
                acc = tl.dot(a, b_desc.load([tn * BN, kt * BK]).T, acc)
            else:
                acc = tl.dot(a, b_desc.load([kt * BK, tn * BN]), acc)
        if ACCUMULATE:
            acc += c_desc.load([tm * BM, tn * BN]).to(tl.float32)
        c_desc.store([tm * BM, tn * BN], rounded(acc, OUT))


def programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def config(M: int, N: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """The tile config of an [M, N] output: the one whose last wave is fullest (the fewest
    idle programs at the end), 128 x 256 on a tie."""
    if INTERPRETED:
        return INTERPRETED_CONFIG
    sms = programs(device)

    def waste(cfg):
        tiles = triton.cdiv(M, cfg[0]) * triton.cdiv(N, cfg[1])
        return (-tiles) % sms / max(tiles, 1)

    return min(CONFIGS, key=waste)


def fits(M: int, K: int, N: int, dtype: torch.dtype) -> bool:
    """TMA's rules: 16-byte aligned rows (K and N multiples of 8 in 16-bit dtypes)."""
    return dtype in _TORCH_DTYPES and K % 8 == 0 and N % 8 == 0 and M > 0


def can_run(device: torch.device) -> bool:
    """Interpreted: CPU tensors. Compiled: CUDA sm90+ (TMA and ``wgmma``)."""
    if INTERPRETED:
        return device.type == "cpu"
    return device.type == "cuda" and torch.cuda.is_available() and torch.version.hip is None \
        and torch.cuda.get_device_capability(device) >= (9, 0)


def gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, *,
         b_kmajor: bool = True, accumulate: bool = False) -> torch.Tensor:
    """``a @ b.T`` (``b_kmajor``: b is [N, K]) or ``a @ b`` (b is [K, N]) into ``out`` (new
    when None), added onto ``out``'s values with ``accumulate``. a [M, K] and b contiguous,
    one 16-bit dtype; fp32 accumulation, rounded once."""
    M, K = a.shape
    N = b.shape[0] if b_kmajor else b.shape[1]
    if (b.shape[1] if b_kmajor else b.shape[0]) != K:
        raise ValueError(f"gemm: a is {tuple(a.shape)}, b {tuple(b.shape)} "
                         f"({'[N, K]' if b_kmajor else '[K, N]'} expected)")
    if out is None:
        if accumulate:
            raise ValueError("gemm: accumulate needs an output to add onto")
        out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out if accumulate else out.zero_()
    cfg = config(M, N, a.device)
    try:
        _launch(a, b, out, b_kmajor, accumulate, *cfg)
    except triton.runtime.errors.OutOfResources:  # a specialization of odd sizes took more
        _launch(a, b, out, b_kmajor, accumulate, *SMALL_CONFIG)
    return out


def _launch(a, b, out, b_kmajor, accumulate, BM, BN, BK, stages, warps):
    M, K = a.shape
    N = out.shape[1]
    a_desc = TensorDescriptor.from_tensor(a, [BM, BK])
    b_desc = TensorDescriptor.from_tensor(b, [BN, BK] if b_kmajor else [BK, BN])
    c_desc = TensorDescriptor.from_tensor(out, [BM, BN])
    n_programs = min(programs(a.device), triton.cdiv(M, BM) * triton.cdiv(N, BN))
    _gemm[(n_programs,)](a_desc, b_desc, c_desc, M, N, K, BM, BN, BK, GROUP_M, n_programs,
                         b_kmajor, accumulate, stages, _TL_DTYPES[out.dtype], num_warps=warps,
                         num_stages=stages)


# -- ops.linear: x @ weight.T (+ acc), with its autograd -------------------------------------------

def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous with a 16-byte aligned start (TMA's rules), copied when not."""
    return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.contiguous()


def _weight_operand(weight: torch.Tensor, transposed: bool) -> tuple[torch.Tensor, bool]:
    """``(b, b_kmajor)`` for ``@ weight.T`` (``transposed``: for ``@ weight``): the stored
    matrix as it lies (weight or the tensor it is a transposed view of) and its layout."""
    if not weight.is_contiguous() and weight.t().is_contiguous():
        return _tma_ready(weight.t()), transposed
    return _tma_ready(weight), not transposed


def _linear_impl(x2: torch.Tensor, weight: torch.Tensor, acc: torch.Tensor | None) -> torch.Tensor:
    b, kmajor = _weight_operand(weight, transposed=False)
    if acc is not None and not (acc.is_contiguous() and acc.data_ptr() % 16 == 0):
        acc = acc.contiguous()
    return gemm(_tma_ready(x2), b, acc, b_kmajor=kmajor, accumulate=acc is not None)


def _linear_op_impl(x2: torch.Tensor, weight: torch.Tensor, acc: torch.Tensor | None) -> torch.Tensor:
    return _linear_impl(x2, weight, None if acc is None else acc.clone())  # functional


def _linear_fake(x2, weight, acc):
    return x2.new_empty((x2.shape[0], weight.shape[0]))


_linear_op = torch.library.custom_op("kohakumoss::triton_linear", _linear_op_impl, mutates_args=())
_linear_op.register_fake(_linear_fake)


def _input_grad_impl(dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    b, kmajor = _weight_operand(weight, transposed=True)
    return gemm(_tma_ready(dy), b, b_kmajor=kmajor)


_input_grad_op = torch.library.custom_op("kohakumoss::triton_linear_input_grad", _input_grad_impl,
                                         mutates_args=())
_input_grad_op.register_fake(lambda dy, weight: dy.new_empty((dy.shape[0], weight.shape[1])))


def _linear_setup(ctx, inputs, output):
    x2, weight, acc = inputs
    ctx.save_for_backward(x2, weight)


def _linear_backward(ctx, dy):
    x2, weight = ctx.saved_tensors
    need_x, need_w, need_acc = ctx.needs_input_grad
    dy = dy.contiguous()
    dx = ctx.bwd(dy, weight) if need_x else None
    dw = torch.mm(dy.t(), x2).to(weight.dtype) if need_w else None
    return dx, dw, dy if need_acc else None


from kohakumoss.kernels.custom import entry, rows2d  # noqa: E402  (after the kernels it wraps)

_linear = entry(_linear_op, _linear_impl, _linear_setup, _linear_backward, _input_grad_op,
                _input_grad_impl)


def linear(x: torch.Tensor, weight: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.linear`` on this GEMM: ``x @ weight.T (+ acc)``, accumulated onto ``acc`` in
    place where no autograd or dispatch mode sees it; the input gradient is the same kernel
    (``dy @ weight``), a weight's gradient cuBLAS's."""
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    if x.dtype not in _TORCH_DTYPES or weight.dtype != x.dtype or (acc is not None and acc.dtype != x.dtype):
        raise TypeError(f"linear (triton): {x.dtype} input, {weight.dtype} weight; the GEMM "
                        f"takes one of bfloat16 / float16")
    if not can_run(x.device) or weight.device != x.device:
        raise RuntimeError(f"linear (triton): cannot run on {x.device}; it needs CUDA sm90+")
    K = x.shape[-1]
    x2 = rows2d(x, K)
    if acc is not None and (is_in_torch_dispatch_mode() or (torch.is_grad_enabled() and acc.requires_grad)):
        return linear(x, weight) + acc  # out of place: acc stays as a mode or autograd saw it
    y = _linear(x2, weight, None if acc is None else acc.reshape(x2.shape[0], weight.shape[0]))
    return y.view(*x.shape[:-1], weight.shape[0])
