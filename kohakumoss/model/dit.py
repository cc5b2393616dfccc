"""The MOSS-Image DiT (``docs/model.md``), named as the official state dict.

Legend: N_img / N_txt / N_joint packed token counts, B samples, D width, H heads, Dh head
dim, C latent channels, T text width. Every op with numerics of its own goes through the
op table (``self.ops``, one per model); the model holds no engine logic. Its repeated blocks
are declared in ``REPEATED``, and each block's halves (attention, MLP) in ``HALVES``, so
checkpointing, streaming and sharding engines can find them from outside
(``kohakumoss.memory``, ``docs/engines.md``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import nn

from kohakumoss.model.config import DiTConfig
from kohakumoss.model.engines import EngineRegistry
from kohakumoss.model.layout import PackedLayout
from kohakumoss.model.ops import OpTable, added_norm, compute_dtype, stream_norm

# modules kept in max(float32, compute dtype) whatever the compute dtype (docs/model.md)
FP32_MODULES = ("time_embedding", "shared_block_modulation", "video_head_modulation")
# module lists whose entries are the repeated blocks engines act on
REPEATED = ("text_embedder.blocks", "layers")
# each repeated block's halves, methods its forward calls in this order (sub-block engines)
HALVES = ("attention", "mlp")
# a caller's function run in place of a joint block: (block, x, mod, rope, layout, ops) -> x
Replacement = Callable[..., torch.Tensor]


class RMSNormWeight(nn.Module):
    """Holds one RMSNorm weight (``<name>.weight``); the math lives in the op table."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class RopeBands(nn.Module):
    """``rope.bands``: 1 / base^(b / NB) in float32, always derived (never loaded)."""

    def __init__(self, bands: int, base: float):
        super().__init__()
        self.n, self.base = bands, base
        self.register_buffer("bands", self.compute(), persistent=False)

    def compute(self, device: torch.device | str | None = None) -> torch.Tensor:
        exponent = torch.arange(self.n, dtype=torch.float32, device=device) / self.n
        return torch.reciprocal(torch.pow(torch.tensor(self.base, dtype=torch.float32,
                                                       device=device), exponent))

    def reset(self, device: torch.device | str | None = None) -> None:
        self.bands = self.compute(device)

    def _apply(self, fn, recurse=True):  # a cast or a move recomputes the fp32 buffer
        super()._apply(fn, recurse)
        if self.bands.device.type != "meta":
            self.reset(self.bands.device)
        return self


class TextBlock(nn.Module):
    # each half's tail: its last linear, whose output only the half's residual add reads
    # (engines that recompute a half may leave it out, ``kohakumoss.memory.replay``)
    TAILS = {"attention": "proj", "mlp": "ffn_down"}

    def __init__(self, c: DiTConfig, engines: EngineRegistry):
        super().__init__()
        D, F = c.dim, c.ffn_dim
        self.heads, self.eps = c.heads, c.eps
        self.engines = engines  # the model's registry: what runs each part (``PARTS``)
        self.norm1, self.norm2 = RMSNormWeight(D), RMSNormWeight(D)
        self.q_norm, self.k_norm = RMSNormWeight(c.head_dim), RMSNormWeight(c.head_dim)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.ffn_gate = nn.Linear(D, F)
        self.ffn_up = nn.Linear(D, F)
        self.ffn_down = nn.Linear(F, D)

    def forward(self, x_ND, rope, lengths, ops: OpTable):
        return self.engines.part(self, "forward")(x_ND, rope, lengths, ops)

    def run_block(self, x_ND, rope, lengths, ops: OpTable):
        """The block's own forward (``forward`` runs it, or an engine's wrap of it)."""
        part = self.engines.part
        return part(self, "mlp")(part(self, "attention")(x_ND, rope, lengths, ops), ops)

    def attention(self, x_ND, rope, lengths, ops: OpTable):
        N, D = x_ND.shape
        y = ops.rms_norm(x_ND, self.norm1.weight, self.eps)
        q, k, v = self.qkv(y).view(N, 3, self.heads, D // self.heads).unbind(1)
        q = ops.qk_norm_rope(q, self.q_norm.weight, *rope, self.eps)
        k = ops.qk_norm_rope(k, self.k_norm.weight, *rope, self.eps)
        o = ops.varlen_attention(q, k, v, lengths).reshape(N, D)
        return ops.residual(x_ND, self.proj(o))

    def mlp(self, x_ND, ops: OpTable):
        y = ops.rms_norm(x_ND, self.norm2.weight, self.eps)
        return ops.residual(x_ND, self.ffn_down(ops.situ(self.ffn_up(y), self.ffn_gate(y))))


class TextEmbedder(nn.Module):
    def __init__(self, c: DiTConfig, engines: EngineRegistry):
        super().__init__()
        self.proj = nn.Linear(c.text_dim, c.dim)
        self.blocks = nn.ModuleList(TextBlock(c, engines) for _ in range(c.text_blocks))


class JointBlock(nn.Module):
    # each half's tail, as ``TextBlock.TAILS``: read by the half's gated residual add alone
    TAILS = {"attention": "proj.o", "mlp": "proj.ffn_down"}

    def __init__(self, c: DiTConfig, engines: EngineRegistry):
        super().__init__()
        D, F = c.dim, c.ffn_dim
        self.heads, self.eps, self.ffn_dim = c.heads, c.eps, F
        self.engines = engines  # the model's registry: what runs each part (``PARTS``)
        self.stream_scale = 1.0  # set by set_stream_scale (fp16): not a weight
        self.norm1, self.norm2 = RMSNormWeight(D), RMSNormWeight(D)
        self.q_norm, self.k_norm = RMSNormWeight(c.head_dim), RMSNormWeight(c.head_dim)
        self.proj = nn.ModuleDict({
            "q": nn.Linear(D, D, bias=False), "k": nn.Linear(D, D, bias=False),
            "v": nn.Linear(D, D, bias=False), "o": nn.Linear(D, D, bias=False),
            "ffn_up_gate": nn.Linear(D, 2 * F, bias=False),
            "ffn_down": nn.Linear(F, D, bias=False),
        })

    def forward(self, x_ND, mod_B6D, seg_N, rope, lengths, ops: OpTable):
        return self.engines.part(self, "forward")(x_ND, mod_B6D, seg_N, rope, lengths, ops)

    def run_block(self, x_ND, mod_B6D, seg_N, rope, lengths, ops: OpTable):
        """The block's own forward (``forward`` runs it, or an engine's wrap of it)."""
        part = self.engines.part
        x_ND = part(self, "attention")(x_ND, mod_B6D, seg_N, rope, lengths, ops)
        return part(self, "mlp")(x_ND, mod_B6D, seg_N, ops)

    def _stream(self, gate):
        """The norm's eps and the gate for a stream carried times ``stream_scale`` (s, a power
        of two): ``norm(s x; s^2 eps) = norm(x; eps)`` and ``s x + (s g) y = s (x + g y)``,
        exactly in floating point; with s = 1 the plain values."""
        s = self.stream_scale
        return (self.eps, gate) if s == 1.0 else (self.eps * s * s, gate * s)

    def attention(self, x_ND, mod_B6D, seg_N, rope, lengths, ops: OpTable):
        """The attention half as a part: ``x + gate_a * o(attn(norm1(x)))``, its add made."""
        return self.closed(self.attention_half(x_ND, None, mod_B6D, seg_N, rope, lengths, ops), seg_N, ops)

    def mlp(self, x_ND, mod_B6D, seg_N, ops: OpTable):
        """The MLP half as a part: ``x + gate_f * down(situ(up_gate(norm2(x))))``, its add made."""
        return self.closed(self.mlp_half(x_ND, None, mod_B6D, seg_N, ops), seg_N, ops)

    def chained(self, x_ND, pending, mod_B6D, seg_N, rope, lengths, ops: OpTable):
        """The same halves with each one's closing gated add left to the norm that opens the
        next (``ops.added_norm``: one kernel, and one in backward, where the table has them).
        The stream is ``x + gate * branch`` with ``pending = (branch, gate)`` (None: x itself);
        returns the same pair after this block."""
        x_ND, pending = self.attention_half(x_ND, pending, mod_B6D, seg_N, rope, lengths, ops)
        return self.mlp_half(x_ND, pending, mod_B6D, seg_N, ops)

    def attention_half(self, x_ND, pending, mod_B6D, seg_N, rope, lengths, ops: OpTable):
        """The block's attention half, the one definition both ways run: on the stream
        ``x + pending``, ``(x, (o(attn(norm1(x))), gate_a))`` with the add still to make."""
        y, x_ND, gate = self._open(x_ND, pending, self.norm1, mod_B6D[:, 0:3], seg_N, ops)
        return x_ND, (self._attend(y, rope, lengths, ops), gate)

    def mlp_half(self, x_ND, pending, mod_B6D, seg_N, ops: OpTable):
        """The block's MLP half, as ``attention_half``: ``(x, (down(situ(up_gate(norm2(x)))),
        gate_f))``."""
        y, x_ND, gate = self._open(x_ND, pending, self.norm2, mod_B6D[:, 3:6], seg_N, ops)
        return x_ND, (self._ffn(y, ops), gate)

    @staticmethod
    def closed(stream, seg_N, ops: OpTable):
        """``x + gate * branch`` of a half's ``(x, (branch, gate))``."""
        x_ND, (branch, gate) = stream
        return ops.gated_residual(x_ND, branch, gate, seg_N)

    def _open(self, x_ND, pending, norm, mod_B3D, seg_N, ops: OpTable):
        """A half's start: (its norm of the stream, the stream, its own gate), the pending add
        made first (by the norm's ``added`` form where it has one); ``mod``: the half's shift,
        scale and gate."""
        eps, gate = self._stream(mod_B3D[:, 2])
        shift, scale = mod_B3D[:, 0], mod_B3D[:, 1]
        if pending is None:
            y, x_ND = stream_norm(ops.modulated_rms_norm, x_ND, norm.weight, shift, scale, seg_N, eps)
        else:
            y, x_ND = added_norm(ops.modulated_rms_norm, ops.gated_residual, x_ND, *pending,
                                 norm.weight, shift, scale, seg_N, eps)
        return y, x_ND, gate

    def _attend(self, y_ND, rope, lengths, ops: OpTable):
        """The attention half's branch on its normed input: ``o(attn(y))``."""
        N, D = y_ND.shape
        Dh = D // self.heads
        p = self.proj
        q, k, v = self._linears(y_ND, (p["q"], p["k"], p["v"]), ops)
        q = ops.qk_norm_rope(q.view(N, self.heads, Dh), self.q_norm.weight, *rope, self.eps)
        k = ops.qk_norm_rope(k.view(N, self.heads, Dh), self.k_norm.weight, *rope, self.eps)
        v = v.view(N, self.heads, Dh)
        o = ops.varlen_attention(q, k, v, lengths).reshape(N, D)
        return self._linears(o, (p["o"],), ops)[0]

    def _ffn(self, y_ND, ops: OpTable):
        """The MLP half's branch on its normed input: ``down(situ(up_gate(y)))``."""
        p = self.proj
        u, g = self._linears(y_ND, (p["ffn_up_gate"],), ops)[0].split(self.ffn_dim, dim=-1)
        return self._linears(ops.situ(u, g), (p["ffn_down"],), ops)[0]

    def _linears(self, x, modules, ops: OpTable):
        """``modules`` on one input through the table's ``linears``, plain ones as the
        registry rules (``EngineRegistry.plain_linear``)."""
        return ops.linears(x, modules, ops.linear, self.engines.plain_linear)


class MOSSImageTransformer(nn.Module):
    """``(img [N_img, C], text [N_txt, T], sigma [B], layout) -> velocity [N_img, C]``."""

    def __init__(self, config: DiTConfig, ops: OpTable | None = None):
        super().__init__()
        c = self.config = config
        self.ops = ops if ops is not None else OpTable()  # its own: engines replace entries
        self.engines = EngineRegistry()  # what engines are applied (``model/engines.py``)
        D = c.dim
        self.video_embedder = nn.Linear(c.latent_channels, D)
        self.text_embedder = TextEmbedder(c, self.engines)
        self.rope = RopeBands(c.rope_bands, c.rope_base)
        self.time_embedding = nn.Sequential(nn.Linear(c.freq_dim, D), nn.SiLU(), nn.Linear(D, D))
        self.shared_block_modulation = nn.Linear(D, 6 * D)
        self.layers = nn.ModuleList(JointBlock(c, self.engines) for _ in range(c.depth))
        self.final_norm_video = RMSNormWeight(D)
        self.final_linear_video = nn.Linear(D, c.latent_channels, bias=False)
        self.video_head_modulation = nn.Linear(D, 2 * D)
        self.chain_adds = True  # each half's closing add made by the next half's norm (``chained_blocks``)

    @property
    def stream_scale(self) -> float:
        """The factor the joint residual stream is carried at (1: as the reference)."""
        return self.layers[0].stream_scale if len(self.layers) else 1.0

    def set_stream_scale(self, s: float) -> None:
        """Carry the joint stream times ``s``, a power of two (fp16: its sum over 42 blocks
        stays in range); outputs are unchanged, exactly, barring subnormals."""
        if s <= 0 or 2.0 ** round(math.log2(s)) != s:
            raise ValueError(f"stream scale {s!r}: a power of two")
        for block in self.layers:
            block.stream_scale = float(s)

    @property
    def dtype(self) -> torch.dtype:
        return self.video_embedder.weight.dtype

    def conditioning(self, sigma_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block modulation [B, 6, D] and head modulation [B, 2, D], float32."""
        c = self.config
        e = self.ops.timestep_embedding(sigma_B.float() * c.time_scale, c.freq_dim)
        cd = self.time_embedding[0].weight.dtype
        tau = self.time_embedding(e.to(cd)).float()
        mod = self.shared_block_modulation(tau.to(cd)).float().view(-1, 6, c.dim)
        head = self.video_head_modulation(tau.to(cd)).float().view(-1, 2, c.dim)
        return mod, head

    def refine_text(self, text_NT: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
        ops, c = self.ops, self.config
        x = self.text_embedder.proj(text_NT.to(self.dtype))
        rope = ops.rope_angles(layout.pos_txt, self.rope.bands, c.rope_axes, x.dtype)
        for block in self.text_embedder.blocks:
            x = block(x, rope, layout.text_len, ops)
        return x

    def forward(self, img_NC: torch.Tensor, text_NT: torch.Tensor, sigma_B: torch.Tensor,
                layout: PackedLayout, refined: torch.Tensor | None = None,
                replace: Mapping[int, Replacement] | None = None) -> torch.Tensor:
        """The velocity of the image tokens. ``refined``: the text refiner's output for
        ``text_NT`` made earlier (a sampler keeps it while the text and the weights stay, where
        ``engines.text_reusable()``); ``replace``: joint blocks run by the caller's function
        instead (``Replacement``; the sampler's skipped layers). Every engine applied runs
        around it (``engines.around_forward``)."""
        with self.engines.around_forward(torch.is_grad_enabled()):
            mod, head = self.conditioning(sigma_B)
            txt = self.refine_text(text_NT, layout) if refined is None else refined
            x, rope = self.joint_input(img_NC, txt, layout)
            x = self.joint_blocks(x, mod, rope, layout, replace or {})
            return self.head(x, head, layout)

    def joint_input(self, img_NC: torch.Tensor, txt_ND: torch.Tensor, layout: PackedLayout
                    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The joint stream (image and refined text tokens in their packed places, times
        ``stream_scale``) and its RoPE angles."""
        c = self.config
        img = self.video_embedder(img_NC.to(self.dtype))
        x = img.new_empty(layout.n_joint, c.dim)
        x = x.index_copy(0, layout.img_in_joint, img).index_copy(0, layout.txt_in_joint, txt_ND)
        s = self.stream_scale
        if s != 1.0:  # the joint stream carried times s (fp16's range), undone by the norms
            x = x * s
        return x, self.ops.rope_angles(layout.pos_joint, self.rope.bands, c.rope_axes, x.dtype)

    def joint_blocks(self, x: torch.Tensor, mod: torch.Tensor, rope: tuple, layout: PackedLayout,
                     replace: Mapping[int, Replacement]) -> torch.Tensor:
        """The joint blocks over the stream. Each runs ``JointBlock.chained`` (its closing adds
        made by the next half's norm) unless ``chain_adds`` is off, an engine needs its calls
        (``engines.runs_whole``) or ``replace`` has it; the pending add is made before a block
        that runs whole."""
        ops, seg, lengths = self.ops, layout.seg_joint, layout.joint_len
        pending = None
        for n, block in enumerate(self.layers):
            if self.chain_adds and n not in replace and not self.engines.runs_whole(block):
                x, pending = block.chained(x, pending, mod, seg, rope, lengths, ops)
                continue
            if pending is not None:
                x, pending = ops.gated_residual(x, *pending, seg), None
            x = replace[n](block, x, mod, rope, layout, ops) if n in replace else \
                block(x, mod, seg, rope, lengths, ops)
        return x if pending is None else ops.gated_residual(x, *pending, seg)

    def head(self, x: torch.Tensor, head: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
        """The image tokens' velocity from the joint stream (the head modulation ``head``)."""
        s = self.stream_scale
        y = self.ops.modulated_rms_norm(x[layout.img_in_joint], self.final_norm_video.weight,
                                        head[:, 0], head[:, 1], layout.seg_img, self.config.eps * s * s)
        return self.final_linear_video(y)

    def chained_blocks(self) -> list[bool]:
        """Which joint blocks a forward runs ``chained`` (none replaced)."""
        return [self.chain_adds and not self.engines.runs_whole(b) for b in self.layers]


def cast_model(model: MOSSImageTransformer, dtype: torch.dtype) -> MOSSImageTransformer:
    """Cast to the compute ``dtype``, keeping ``FP32_MODULES`` in max(float32, dtype)."""
    model.to(dtype)
    keep = compute_dtype(dtype)
    for name in FP32_MODULES:
        model.get_submodule(name).to(keep)
    return model
