"""The ``compile`` backend: ``torch.compile`` of each elementwise reference.

The same math as the reference (fp32 inside, one rounding out), fused by Inductor into a
kernel or two per direction; forward and backward both compiled (AOTAutograd). The token
dimension of every per-token input (and the sample dimension of the per-sample vectors) is
marked dynamic, so one compile serves every token count of a run; the model sizes (D, F,
H, Dh) stay static, so the kernels are specialised to them. A new dtype, grad mode or
memory layout compiles once more (Dynamo's guards).

The first call compiles, lazily: a machine that cannot compile (no C++ compiler for the CPU
code, no Triton for CUDA, an Inductor bug) raises there: the tuner records the failure and
never picks it, and in a run's table it is a ``dispatch.BackendFailed`` naming the knob that
leaves it out (``kernels.backends``). Runs wherever ``torch.compile`` does: CPU and CUDA.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kohakumoss.kernels.registry import register_backend
from kohakumoss.model import ops

NAME = "compile"

# op -> the positions of the tensor arguments whose first dimension is tokens or samples
DYNAMIC: dict[str, tuple[int, ...]] = {
    "rms_norm": (0,),
    "modulated_rms_norm": (0, 2, 3, 4),
    "qk_norm_rope": (0, 2, 3),
    "situ": (0, 1),
    "residual": (0, 1),
    "gated_residual": (0, 1, 2, 3),
}

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class CompiledOp:
    """``torch.compile(reference)``, built on the first call; marks the token dimensions
    dynamic before each call so token counts never recompile."""

    def __init__(self, op: str, fn: Callable, dynamic: tuple[int, ...]):
        self.op, self.fn, self.dynamic = op, fn, dynamic
        self._compiled: Callable | None = None
        self.__qualname__ = f"compiled({op})"

    def __call__(self, *args):
        if self._compiled is None:
            _room_to_recompile()
            self._compiled = torch.compile(self.fn, fullgraph=True, dynamic=None)
        for i in self.dynamic:
            t = args[i]
            if t.dim():
                torch._dynamo.maybe_mark_dynamic(t, 0)
        return self._compiled(*args)


# compiles one reference may need in one process: each (dtype, grad mode, memory layout)
# of each model's table compiles once (Dynamo keys them on the reference's one code object),
# so a run with previews and a sampler beside it passes Dynamo's default of 8; past the
# limit a fullgraph compile fails, which is a run-time error of the backend
RECOMPILE_LIMIT = 64


def _room_to_recompile() -> None:
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    if dtype not in FLOATS:
        return False
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        try:
            from torch.utils._triton import has_triton
        except ImportError:
            return False
        return has_triton()
    return False


COMPILED: dict[str, CompiledOp] = {op: CompiledOp(op, ops.REFERENCE[op], dyn)
                                   for op, dyn in DYNAMIC.items()}
for _op, _fn in COMPILED.items():
    register_backend(_op, NAME, _fn, available)
