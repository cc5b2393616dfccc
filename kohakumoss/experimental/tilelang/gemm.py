"""The ``tilelang`` backend of ``ops.linear``: a block linear's product ``x @ weight.T`` (and
``+ acc``: the LoRA node's base product lands on the adapter's output) as a TileLang GEMM,
forward and input gradient (``dy @ weight``, the same kernel in the other layout), with fake
and autograd registrations; a weight's own gradient (full finetunes) is cuBLAS's.

The kernel copies whole tiles, which TileLang lowers to TMA loads feeding ``wgmma`` in a
warp-specialized pipeline on sm90 (one producer warpgroup, two consumer warpgroups), to
``cp.async`` and ``mma.sync`` before. fp32 accumulation, one rounding out; the accumulating
form reads the output tile into the shared buffer it then stores from (no more shared memory
than the plain one). Token counts are dynamic: one build per (K, O, dtype, layout,
accumulation) serves a whole run. On the H200 this GEMM ran at 0.97-1.16x cuBLAS's speed at
the block linears' shapes (``docs/performance.md``), so the tuner picks per shape.

Importing this module imports TileLang; ``kohakumoss.kernels.backends`` imports it lazily.
No ``from __future__ import annotations`` here: TileLang reads the kernels' annotations.

Legend: M rows (tokens), K the summed dimension, O output columns, BM x BN x BK a tile.
"""


import functools

import tilelang
import tilelang.language as T
import torch

from kohakumoss.kernels.custom import entry, rows2d

M = T.dynamic("M")
DTYPES = (torch.bfloat16, torch.float16)
_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
# (BM, BN, BK, stages, threads): the H200 sweep's best at the DiT's shapes (128 x 256, 3 stages,
# two consumer warpgroups); smaller tiles before sm90 (less shared memory, no wgmma)
SM90_TILES = (128, 256, 64, 3, 256)
SM80_TILES = (128, 128, 32, 2, 256)


def gemm_kernel(K: int, O: int, dtype: str, b_kmajor: bool, accumulate: bool,
                BM: int, BN: int, BK: int, stages: int, threads: int):
    """``C (+)= A @ B.T`` (``b_kmajor``: B is [O, K]) or ``A @ B`` (B is [K, O]); A [M, K]."""
    b_shape = (O, K) if b_kmajor else (K, O)

    @T.prim_func
    def kernel(A: T.Tensor((M, K), dtype), B: T.Tensor(b_shape, dtype), C: T.Tensor((M, O), dtype)):
        with T.Kernel(T.ceildiv(O, BN), T.ceildiv(M, BM), threads=threads) as (bx, by):
            a_s = T.alloc_shared((BM, BK), dtype)
            b_s = T.alloc_shared((BN, BK) if b_kmajor else (BK, BN), dtype)
            c_s = T.alloc_shared((BM, BN), dtype)
            acc = T.alloc_fragment((BM, BN), "float32")
            T.use_swizzle(panel_size=10)  # row tiles in panels: a panel's weight tiles stay in L2
            T.clear(acc)
            for kt in T.Pipelined(T.ceildiv(K, BK), num_stages=stages):
                T.copy(A[by * BM, kt * BK], a_s)
                if b_kmajor:
                    T.copy(B[bx * BN, kt * BK], b_s)
                else:
                    T.copy(B[kt * BK, bx * BN], b_s)
                T.gemm(a_s, b_s, acc, transpose_B=b_kmajor)
            if accumulate:
                T.copy(C[by * BM, bx * BN], c_s)
                for i, j in T.Parallel(BM, BN):
                    acc[i, j] = acc[i, j] + T.cast(c_s[i, j], "float32")
            T.copy(acc, c_s)
            T.copy(c_s, C[by * BM, bx * BN])

    return kernel


def tiles(capability: tuple[int, int]) -> tuple[int, int, int, int, int]:
    return SM90_TILES if capability >= (9, 0) else SM80_TILES


@functools.lru_cache(maxsize=None)
def _build(K: int, O: int, dtype: str, b_kmajor: bool, accumulate: bool, cfg: tuple):
    return tilelang.compile(gemm_kernel(K, O, dtype, b_kmajor, accumulate, *cfg))


def can_run(device: torch.device, dtype: torch.dtype) -> bool:
    """CUDA sm80+ (``cp.async``; TMA and ``wgmma`` from sm90), 16-bit dtypes."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and torch.version.hip is None \
        and dtype in DTYPES and torch.cuda.get_device_capability(device) >= (8, 0)


def _ready(t: torch.Tensor) -> torch.Tensor:
    """Contiguous with a 16-byte aligned start (TMA's rules), copied when not."""
    return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.contiguous()


def gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, *,
         b_kmajor: bool = True, accumulate: bool = False) -> torch.Tensor:
    """``a @ b.T`` (``b_kmajor``) or ``a @ b`` into ``out`` (new when None), added onto its
    values with ``accumulate``."""
    (rows, K), O = a.shape, (b.shape[0] if b_kmajor else b.shape[1])
    if out is None:
        out = torch.empty((rows, O), dtype=a.dtype, device=a.device)
    if rows and O:
        cfg = tiles(torch.cuda.get_device_capability(a.device))
        _build(K, O, _NAMES[a.dtype], b_kmajor, accumulate, cfg)(_ready(a), _ready(b), out)
    return out


def _weight_operand(weight: torch.Tensor, transposed: bool) -> tuple[torch.Tensor, bool]:
    """``(b, b_kmajor)`` for ``@ weight.T`` (``transposed``: for ``@ weight``): the stored
    matrix (weight, or the tensor it is a transposed view of) and its layout."""
    if not weight.is_contiguous() and weight.t().is_contiguous():
        return weight.t(), transposed
    return _ready(weight), not transposed


def _linear_impl(x2: torch.Tensor, weight: torch.Tensor, acc: torch.Tensor | None) -> torch.Tensor:
    b, kmajor = _weight_operand(weight, transposed=False)
    if acc is not None:
        acc = _ready(acc)
    return gemm(x2, b, acc, b_kmajor=kmajor, accumulate=acc is not None)


def _linear_op_impl(x2: torch.Tensor, weight: torch.Tensor, acc: torch.Tensor | None) -> torch.Tensor:
    return _linear_impl(x2, weight, None if acc is None else acc.clone())  # functional


def _input_grad_impl(dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    b, kmajor = _weight_operand(weight, transposed=True)
    return gemm(dy, b, b_kmajor=kmajor)


_linear_op = torch.library.custom_op("kohakumoss::tilelang_linear", _linear_op_impl, mutates_args=())
_linear_op.register_fake(lambda x2, weight, acc: x2.new_empty((x2.shape[0], weight.shape[0])))
_input_grad_op = torch.library.custom_op("kohakumoss::tilelang_linear_input_grad", _input_grad_impl,
                                         mutates_args=())
_input_grad_op.register_fake(lambda dy, weight: dy.new_empty((dy.shape[0], weight.shape[1])))


def _setup(ctx, inputs, output):
    x2, weight, _ = inputs
    ctx.save_for_backward(x2, weight)


def _backward(ctx, dy):
    x2, weight = ctx.saved_tensors
    need_x, need_w, need_acc = ctx.needs_input_grad
    dy = dy.contiguous()
    return (ctx.bwd(dy, weight) if need_x else None,
            torch.mm(dy.t(), x2).to(weight.dtype) if need_w else None,
            dy if need_acc else None)


_linear = entry(_linear_op, _linear_impl, _setup, _backward, _input_grad_op, _input_grad_impl)


def linear(x: torch.Tensor, weight: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.linear`` on this GEMM: ``x @ weight.T (+ acc)``, accumulated onto ``acc`` in
    place where no autograd or dispatch mode sees it (else out of place)."""
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    if x.dtype not in DTYPES or weight.dtype != x.dtype or (acc is not None and acc.dtype != x.dtype):
        raise TypeError(f"linear (tilelang): {x.dtype} input, {weight.dtype} weight; the GEMM "
                        f"takes one of bfloat16 / float16")
    if not torch.compiler.is_compiling() and not can_run(x.device, x.dtype):
        raise RuntimeError(f"linear (tilelang): cannot run on {x.device}; it needs CUDA sm80+")
    if acc is not None and (is_in_torch_dispatch_mode() or (torch.is_grad_enabled() and acc.requires_grad)):
        return linear(x, weight) + acc  # out of place: acc stays as a mode or autograd saw it
    x2 = rows2d(x, x.shape[-1])
    y = _linear(x2, weight, None if acc is None else acc.reshape(x2.shape[0], weight.shape[0]))
    return y.view(*x.shape[:-1], weight.shape[0])
