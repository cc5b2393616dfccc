"""The norms (``model.ops``: ``rms_norm``, ``modulated_rms_norm``): their problem shapes and
their Triton backend (``triton.py``; the modulated norm's ``stream`` and ``added`` forms in
``triton_forms.py``: ``ops.stream_norm``, ``ops.added_norm``)."""

from __future__ import annotations

import torch

from kohakumoss.kernels.backends import register_triton
from kohakumoss.kernels.problems import Problem, rand, register_problem, rows, segments

MODULE = "kernels.norm.triton"


def _make_rms(d, dtype, device, g, wg):
    return (rand(g, device, dtype, d["N"], d["D"]), rand(g, device, dtype, d["D"], grad=wg), 1e-6)


def _make_mod_rms(d, dtype, device, g, wg):
    f32 = torch.float32
    return (rand(g, device, dtype, d["N"], d["D"]), rand(g, device, dtype, d["D"], grad=wg),
            rand(g, device, f32, d["B"], d["D"], grad=wg),
            rand(g, device, f32, d["B"], d["D"], grad=wg), segments(d["N"], d["B"], device), 1e-6)


register_problem(Problem("rms_norm", lambda x, w, eps: {"N": rows(x), "D": x.shape[-1]},
                         ("N", "D"), _make_rms))
register_problem(Problem("modulated_rms_norm",
                         lambda x, w, shift, scale, seg, eps: {"N": x.shape[0], "D": x.shape[1],
                                                               "B": shift.shape[0]},
                         ("N", "D"), _make_mod_rms))
register_triton("rms_norm", MODULE)
FORMS = "kernels.norm.triton_forms"
register_triton("modulated_rms_norm", MODULE, forms={
    "stream": (FORMS, "stream_modulated_rms_norm"),  # ``ops.stream_norm``
    "added": (FORMS, "added_modulated_rms_norm"),  # ``ops.added_norm``
})
