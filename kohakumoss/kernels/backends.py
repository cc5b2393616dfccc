"""The kernel backends, registered in ``KERNELS`` when ``kohakumoss.kernels`` is imported.

- ``triton``: rms_norm, modulated_rms_norm, qk_norm_rope, situ, residual, gated_residual;
  CUDA sm80+ in fp32/bf16/fp16, or CPU tensors where Triton was first imported with
  ``TRITON_INTERPRET=1`` (its interpreter: tests, CI). Each saves only its inputs for
  backward, so the memory engines do not wrap it in recomputation.
- the quantized base's (quant_linear, fp8_linear, fp8_lora_linears) register with their ops
  in ``kohakumoss.quant`` (``quant/backends.py``).
- ``flash_varlen`` (varlen_attention): CUDA sm80+, bf16/fp16, head dim a multiple of 8 up
  to 256.
- ``flex`` (varlen_attention): CUDA sm80+, fp32/bf16/fp16, head dim a power of two from 16.
- ``fa4`` (varlen_attention): FlashAttention-4 (the optional ``flash-attn-4`` package, the
  ``fa4`` extra); CUDA sm90-sm110, bf16/fp16, head dims 32, 64, 96 and 128.
- ``tilelang`` (linear): the block linears' products as a TileLang GEMM (``tilelang_gemm``),
  forward and input gradient, the LoRA nodes' accumulating base products too; CUDA sm80+,
  bf16/fp16, K and O multiples of 8; opt-in like the rest of TileLang's kernels.
- ``tilelang`` (rms_norm, modulated_rms_norm, situ, gated_residual, varlen_attention): CUDA
  sm70+ (bf16 from sm80; attention bf16/fp16, head dims a multiple of 32 up to 256). The fused
  kernels of sm70 / sm75, where Triton does not run; on sm80+ the tuner times them only when
  ``kernels.backends`` names ``tilelang`` (``opt_in``): their first build is nvcc seconds.

Triton, TileLang and FA4 are imported lazily, on the first availability question or call: a
machine without them, or one where they fail to import, reports these backends unavailable
(the reason is logged once) and ``kohakumoss`` imports as ever. The attention backends declare their
head-dim limits (``fits``): the dispatch, tuned or static, passes a backend over for a call
it does not take; called directly, a backend gives such inputs to the reference itself.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from types import ModuleType

import torch

from kohakumoss.kernels import attention
from kohakumoss.kernels.registry import register_backend

log = logging.getLogger(__name__)

TRITON_OPS = {  # op -> the module holding its Triton kernels
    "rms_norm": "triton_norm",
    "modulated_rms_norm": "triton_norm",
    "qk_norm_rope": "triton_rope",
    "situ": "triton_pointwise",
    "residual": "triton_pointwise",
    "gated_residual": "triton_pointwise",
    "flow_loss": "triton_loss",
}
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_modules: dict[str, ModuleType | None] = {}
_why: dict[str, str] = {}


def triton_module(name: str) -> ModuleType | None:
    """``kohakumoss.kernels.<name>`` (``kohakumoss.<name>`` for a dotted name: ``quant.triton_fp8``)
    or None when it (its compiler: Triton, TileLang) cannot be imported here; the reason is
    logged once and kept in ``triton_unavailable_reason``."""
    if name not in _modules:
        try:
            _modules[name] = importlib.import_module(f"kohakumoss.{name}" if "." in name
                                                     else f"kohakumoss.kernels.{name}")
        except Exception as e:  # not installed, a broken install, an old version: not available
            _modules[name] = None
            _why[name] = f"{type(e).__name__}: {e}"
            log.info("kernels of %s unavailable: %s", name, _why[name])
    return _modules[name]


def triton_unavailable_reason(op: str) -> str | None:
    module = TRITON_OPS[op]
    return None if triton_module(module) is not None else _why[module]


def triton_available(op: str, module_name: str | None = None
                     ) -> Callable[[torch.device, torch.dtype], bool]:
    """Whether the Triton kernels of ``op`` (in ``module_name``; default: the op's module,
    ``TRITON_OPS``) can run on ``(device, dtype)``: Triton imports, the module too, the
    device runs it."""
    module_name = module_name or TRITON_OPS[op]

    def available(device: torch.device, dtype: torch.dtype) -> bool:
        if dtype not in TRITON_DTYPES:
            return False
        common = triton_module("triton_common")
        return common is not None and triton_module(module_name) is not None \
            and common.can_run(torch.device(device))

    return available


def triton_fn(op: str, name: str | None = None, module_name: str | None = None) -> Callable:
    """The function ``name`` (default: the op's own name) of ``module_name`` (default: the
    op's module, ``TRITON_OPS``), imported on first call."""
    resolved: list[Callable] = []
    name, module_name = name or op, module_name or TRITON_OPS[op]

    def fn(*args):
        if not resolved:
            module = triton_module(module_name)
            if module is None:
                raise RuntimeError(f"{op} (triton): Triton kernels cannot be imported here "
                                   f"({_why[module_name]})")
            resolved.append(getattr(module, name))
        return resolved[0](*args)

    fn.__name__ = name
    fn.__qualname__ = f"triton.{name}"
    return fn


# the other forms (``model.ops.FORMS``) of an op's Triton function, which ``model.ops`` takes
# where a call runs the Triton kernels: form -> (module, function)
TRITON_FORMS = {"modulated_rms_norm": {
    "stream": ("triton_norm_forms", "stream_modulated_rms_norm"),  # ``ops.stream_norm``
    "added": ("triton_norm_forms", "added_modulated_rms_norm"),  # ``ops.added_norm``
}}

for _op in TRITON_OPS:  # each kernel's autograd saves its inputs; backward recomputes the rest
    register_backend(_op, "triton", triton_fn(_op), triton_available(_op), keeps_inputs_only=True,
                     forms={form: triton_fn(_op, name, module)
                            for form, (module, name) in TRITON_FORMS.get(_op, {}).items()})

register_backend("varlen_attention", "flash_varlen", attention.flash_varlen_attention,
                 attention.flash_available, fits=attention.flash_fits)
register_backend("varlen_attention", "flex", attention.flex_varlen_attention,
                 attention.flex_available, fits=attention.flex_fits)


def _fa4_available(device: torch.device, dtype: torch.dtype) -> bool:
    """bf16/fp16 on a card FA4 runs on, with ``flash-attn-4`` importable (asked in that order:
    its import takes seconds, so only where the card could use it)."""
    return (dtype in attention.FLASH_DTYPES and attention.fa4_card(torch.device(device))
            and triton_module("fa4_attention") is not None)


def _fa4_attention(q, k, v, lengths):
    module = triton_module("fa4_attention")
    if module is None:  # bad inputs still say so first (the module checks them itself)
        attention._check("fa4", q, k, v, [int(n) for n in lengths])
        raise RuntimeError(f"varlen_attention (fa4): flash-attn-4 cannot be imported here "
                           f"({_why['fa4_attention']}); pip install 'kohakumoss[fa4]'")
    return module.varlen_attention(q, k, v, lengths)


_fa4_attention.__qualname__ = "fa4.varlen_attention"
register_backend("varlen_attention", "fa4", _fa4_attention, _fa4_available,
                 fits=attention.fa4_fits)


def missing_kernels(device: torch.device | str) -> list[str]:
    """What this device could run that is not installed here, each as a line saying what to
    install (``kmoss tune_kernels`` prints them after its table)."""
    device = torch.device(device)
    if attention.fa4_card(device) and triton_module("fa4_attention") is None:
        return [f"this card can run FlashAttention-4's attention (1.17-1.24x cuDNN's at 1 MP "
                f"on an H200; {_why['fa4_attention']}): pip install 'kohakumoss[fa4]', then "
                f"rerun kmoss tune_kernels"]
    return []


TILELANG_OPS = ("rms_norm", "modulated_rms_norm", "situ", "gated_residual", "varlen_attention")


def _tilelang_available(op: str, module_name: str = "tilelang_ops"
                        ) -> Callable[[torch.device, torch.dtype], bool]:
    def available(device: torch.device, dtype: torch.dtype) -> bool:
        if torch.device(device).type != "cuda":  # asked before TileLang is imported
            return False
        module = triton_module(module_name)
        return module is not None and (module.can_run(device, dtype, True) if op == "varlen_attention"
                                       else module.can_run(device, dtype))

    return available


def _tilelang_fn(op: str, module_name: str = "tilelang_ops") -> Callable:
    def fn(*args):
        module = triton_module(module_name)
        if module is None:
            raise RuntimeError(f"{op} (tilelang): TileLang cannot be imported here "
                               f"({_why[module_name]})")
        return getattr(module, op)(*args)

    fn.__name__, fn.__qualname__ = op, f"tilelang.{op}"
    return fn


def _sm80_or_newer(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


for _op in TILELANG_OPS:  # the norms, SiTU and the gated add keep their inputs only
    register_backend(_op, "tilelang", _tilelang_fn(_op), _tilelang_available(_op),
                     fits=attention.tilelang_fits if _op == "varlen_attention" else None,
                     keeps_inputs_only=_op != "varlen_attention", opt_in=_sm80_or_newer)
register_backend("linear", "tilelang", _tilelang_fn("linear", "tilelang_gemm"),
                 _tilelang_available("linear", "tilelang_gemm"),
                 fits=lambda dims: dims["K"] % 8 == 0 and dims["O"] % 8 == 0,
                 keeps_inputs_only=True, opt_in=_sm80_or_newer)
