"""The block linears' product (``model.ops.linear``): its problem shapes. Its backends are the
reference (cuBLAS) and, opt-in, TileLang's GEMM (``kohakumoss.experimental.tilelang``)."""

from __future__ import annotations

from kohakumoss.kernels.problems import Problem, rand, register_problem, rows


def _make_linear(d, dtype, device, g, wg):
    weight = rand(g, device, dtype, d["O"], d["K"], grad=wg) / d["K"] ** 0.5
    return rand(g, device, dtype, d["N"], d["K"]), weight.detach().requires_grad_(wg)


register_problem(Problem("linear",
                         lambda x, weight, acc=None: {"N": rows(x), "K": x.shape[-1], "O": weight.shape[0]},
                         ("N", "K", "O"), _make_linear))
