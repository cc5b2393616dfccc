"""How the kernel backends load: Triton, TileLang and FA4 are imported lazily, on the first
availability question or call (``triton_module``), so a machine without them, or one where
they fail to import, reports those backends unavailable (the reason is logged once) and
``kohakumoss`` imports as ever. Each op's folder registers its backends with these helpers:

- ``norm/``: rms_norm, modulated_rms_norm (Triton; the norm's ``stream`` and ``added`` forms);
- ``rope/``: qk_norm_rope (Triton);
- ``pointwise/``: situ, residual, gated_residual (Triton);
- ``loss/``: the objective's flow_loss (Triton);
- ``attention/``: varlen_attention (``flash_varlen``, ``flex``, ``fa4``);
- ``linear/``: the block linears' product (the reference; ``compile``);
- ``compiled.py``: ``compile`` (torch.compile of the reference) for the elementwise ops.

The Triton ones run on CUDA sm80+ in fp32/bf16/fp16, or on CPU tensors where Triton was first
imported with ``TRITON_INTERPRET=1`` (its interpreter: tests, CI); each saves only its inputs
for backward, so the memory engines do not wrap it in recomputation. The quantized base's
backends register with their ops in ``kohakumoss.quant`` (``quant/backends.py``); TileLang's
are opt-in, in ``kohakumoss.experimental.tilelang``, loaded when ``kernels.backends`` names
``tilelang``. The attention backends declare their head-dim limits (``fits``): the dispatch,
tuned or static, passes a backend over for a call it does not take.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from types import ModuleType

import torch

from kohakumoss.kernels.registry import register_backend

log = logging.getLogger(__name__)

TRITON_OPS: dict[str, str] = {}
"""op -> the module holding its Triton kernels (``register_triton`` fills it)."""
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_modules: dict[str, ModuleType | None] = {}
_why: dict[str, str] = {}


def triton_module(name: str) -> ModuleType | None:
    """``kohakumoss.<name>`` (``kernels.norm.triton``, ``quant.triton_fp8``) or None when it
    (its compiler: Triton, TileLang, FA4) cannot be imported here; the reason is logged once
    and kept in ``unavailable_reason``."""
    if name not in _modules:
        try:
            _modules[name] = importlib.import_module(f"kohakumoss.{name}")
        except Exception as e:  # not installed, a broken install, an old version: not available
            _modules[name] = None
            _why[name] = f"{type(e).__name__}: {e}"
            log.info("kernels of %s unavailable: %s", name, _why[name])
    return _modules[name]


def unavailable_reason(module: str) -> str | None:
    """Why ``kohakumoss.<module>`` cannot be imported here (None: it can)."""
    return None if triton_module(module) is not None else _why[module]


def triton_unavailable_reason(op: str) -> str | None:
    return unavailable_reason(TRITON_OPS[op])


def triton_available(op: str, module_name: str | None = None
                     ) -> Callable[[torch.device, torch.dtype], bool]:
    """Whether the Triton kernels of ``op`` (in ``module_name``; default: the op's module,
    ``TRITON_OPS``) can run on ``(device, dtype)``: Triton imports, the module too, the
    device runs it."""
    module_name = module_name or TRITON_OPS[op]

    def available(device: torch.device, dtype: torch.dtype) -> bool:
        if dtype not in TRITON_DTYPES:
            return False
        common = triton_module("kernels.triton_common")
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


def register_triton(op: str, module: str, forms: dict[str, tuple[str, str]] | None = None) -> None:
    """Register backend ``triton`` of ``op``: function ``op`` of ``kohakumoss.<module>``
    (imported on first use), saving only its inputs for backward; ``forms``: its other forms
    (``model.ops.FORMS``), form -> (module, function)."""
    TRITON_OPS[op] = module
    register_backend(op, "triton", triton_fn(op, op, module), triton_available(op, module),
                     keeps_inputs_only=True,
                     forms={form: triton_fn(op, name, where) for form, (where, name) in (forms or {}).items()})


def missing_kernels(device: torch.device | str) -> list[str]:
    """What this device could run that is not installed here, each as a line saying what to
    install (``kmoss tune_kernels`` prints them after its table)."""
    from kohakumoss.kernels.attention import varlen

    device = torch.device(device)
    if varlen.fa4_card(device) and triton_module("kernels.attention.fa4") is None:
        return [f"this card can run FlashAttention-4's attention (1.17-1.24x cuDNN's at 1 MP "
                f"on an H200; {_why['kernels.attention.fa4']}): pip install 'kohakumoss[fa4]', "
                f"then rerun kmoss tune_kernels"]
    return []
