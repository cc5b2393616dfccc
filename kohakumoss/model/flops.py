"""Model FLOPs of a packed batch (matmul and attention FLOPs; elementwise ops ignored).

A multiply-add counts 2. Forward: every linear (2 * in * out per token) plus attention
(``4 * S^2 * D`` per sample and block: Q K^T and P V). A full backward costs twice the
forward (input and weight gradients); an adapter backward with frozen base weights costs
about one forward for the linears and twice the forward for attention.
"""

from __future__ import annotations

from kohakumoss.model.config import DiTConfig
from kohakumoss.model.layout import PackedLayout


def forward_flops(c: DiTConfig, layout: PackedLayout) -> float:
    D, F = c.dim, c.ffn_dim
    n_img, n_txt, n_joint = layout.n_img, layout.n_txt, layout.n_joint
    joint_linear = 2 * (4 * D * D + 3 * D * F) * n_joint * c.depth
    joint_attn = sum(4 * s * s * D for s in layout.joint_len) * c.depth
    text_linear = 2 * (3 * D * D + D * D + 3 * D * F) * n_txt * c.text_blocks
    text_attn = sum(4 * s * s * D for s in layout.text_len) * c.text_blocks
    embed = 2 * c.latent_channels * D * n_img * 2 + 2 * c.text_dim * D * n_txt
    return float(joint_linear + joint_attn + text_linear + text_attn + embed)


def train_flops(c: DiTConfig, layout: PackedLayout, full: bool = True) -> float:
    """Forward + backward: 3x forward for a full finetune; for frozen base weights the
    linears' backward needs only input gradients (1x), attention's still 2x."""
    fwd = forward_flops(c, layout)
    if full:
        return 3 * fwd
    attn = (sum(4 * s * s * c.dim for s in layout.joint_len) * c.depth
            + sum(4 * s * s * c.dim for s in layout.text_len) * c.text_blocks)
    return 2 * (fwd - attn) + 3 * attn
