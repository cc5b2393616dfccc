"""The pointwise ops (``model.ops``: ``situ``, ``residual``, ``gated_residual``): their problem
shapes and their Triton backend (``triton.py``)."""

from __future__ import annotations

import torch

from kohakumoss.kernels.backends import register_triton
from kohakumoss.kernels.problems import Problem, rand, register_problem, rows, segments

MODULE = "kernels.pointwise.triton"


def _make_situ(d, dtype, device, g, wg):
    return (rand(g, device, dtype, d["N"], d["F"]), rand(g, device, dtype, d["N"], d["F"]))


def _make_residual(d, dtype, device, g, wg):
    return (rand(g, device, dtype, d["N"], d["D"]), rand(g, device, dtype, d["N"], d["D"]))


def _make_gated(d, dtype, device, g, wg):
    return (rand(g, device, dtype, d["N"], d["D"]), rand(g, device, dtype, d["N"], d["D"]),
            rand(g, device, torch.float32, d["B"], d["D"], grad=wg), segments(d["N"], d["B"], device))


register_problem(Problem("situ", lambda u, g: {"N": rows(u), "F": u.shape[-1]}, ("N", "F"),
                         _make_situ))
register_problem(Problem("residual", lambda x, y: {"N": rows(x), "D": x.shape[-1]}, ("N", "D"),
                         _make_residual))
register_problem(Problem("gated_residual",
                         lambda x, y, gate, seg: {"N": x.shape[0], "D": x.shape[1], "B": gate.shape[0]},
                         ("N", "D"), _make_gated))
for _op in ("situ", "residual", "gated_residual"):
    register_triton(_op, MODULE)
