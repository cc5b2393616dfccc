"""The objective's loss (``diffusion.objective``: ``flow_loss``): its problem shapes and its
Triton backend (``triton.py``)."""

from __future__ import annotations

import torch

from kohakumoss.kernels.backends import register_triton
from kohakumoss.kernels.problems import Problem, rand, register_problem, segments


def _make_loss(d, dtype, device, g, wg):
    n, b = d["N"], d["B"]
    return (rand(g, device, dtype, n, d["C"]), rand(g, device, torch.float32, n, d["C"], grad=False),
            segments(n, b, device), torch.ones(b, device=device), n, "mse", 1.0)


register_problem(Problem("flow_loss",
                         lambda pred, target, seg, weight, n, loss, delta: {
                             "N": pred.shape[0], "C": pred.shape[1], "B": weight.shape[0]},
                         ("N", "C"), _make_loss))
register_triton("flow_loss", "kernels.loss.triton")
