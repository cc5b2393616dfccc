"""The per-head norm and rotation (``model.ops.qk_norm_rope``): its problem shapes and its
Triton backend (``triton.py``)."""

from __future__ import annotations

from kohakumoss.kernels.backends import register_triton
from kohakumoss.kernels.problems import Problem, rand, register_problem
from kohakumoss.model.ops import compute_dtype


def _make_qk(d, dtype, device, g, wg):
    cd = compute_dtype(dtype)
    half = d["Dh"] // 2
    return (rand(g, device, dtype, d["N"], d["H"], d["Dh"]),
            rand(g, device, dtype, d["Dh"], grad=wg),
            rand(g, device, cd, d["N"], half, grad=False),
            rand(g, device, cd, d["N"], half, grad=False), 1e-6)


register_problem(Problem("qk_norm_rope",
                         lambda x, w, cos, sin, eps: {"N": x.shape[0], "H": x.shape[1], "Dh": x.shape[2]},
                         ("N", "H", "Dh"), _make_qk))
register_triton("qk_norm_rope", "kernels.rope.triton")
