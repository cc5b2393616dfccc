"""Euler sampling with classifier-free guidance over packed batches
(``docs/diffusion.md#euler-sampler-with-cfg``).

Every image is a request: its text embedding, its negative embedding (the empty caption's
by default), its latent grid and its seed. Initial noise is drawn per image from its own
seed, on the CPU, in the shape ``[1, 128, h, w]`` and flattened row-major, so an image does
not depend on the batch it is sampled in, nor on the device. With ``cfg != 1`` the positive
and negative branches are packed into one forward (negatives skip the config's
``negative_skip_layers`` and keep their pre-block value there);
``v = u + cfg * (v_pos - u)`` in fp32; Euler steps on the shifted, grid-snapped schedule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Sequence

import torch

from kohakumoss.diffusion.schedule import inference_sigmas
from kohakumoss.model.dit import MOSSImageTransformer, Replacement
from kohakumoss.model.layout import build_layout

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Request:
    text: torch.Tensor  # [L, T] positive prompt embedding
    negative: torch.Tensor  # [L', T] negative (empty caption) embedding
    hw: tuple[int, int]  # latent grid (H/16, W/16)
    seed: int


def initial_noise(seed: int, hw: tuple[int, int], channels: int = 128) -> torch.Tensor:
    h, w = hw
    g = torch.Generator().manual_seed(int(seed))
    return torch.randn(1, channels, h, w, generator=g).flatten(2)[0].T.contiguous()


class Packed:
    """What stays fixed over a sampling run, packed and on the device once: the layout of
    the requests (positives, then their negatives with CFG), the text tokens (and, after the
    first step, the text refiner's output: the refiner does not see the timestep), the
    negatives' skip mask. Each step then only sends the latents through the model, with no
    host-to-device copy that would make the host wait for the GPU between steps."""

    def __init__(self, reqs: Sequence[Request], cfg: float, device, dtype):
        self.B, self.cfg = len(reqs), cfg
        hw = [r.hw for r in reqs]
        texts = [r.text for r in reqs]
        self.skip = None
        if cfg != 1.0:  # the negatives last: a skipped layer runs on the positives' tokens alone
            hw, texts = hw + hw, texts + [r.negative for r in reqs]
            self.skip = (False,) * self.B + (True,) * self.B
        self.layout = build_layout(hw, [len(t) for t in texts]).to(device)
        self.text = torch.cat(texts).to(device=device, dtype=dtype)
        self.n_img = sum(self.layout.img_len[:self.B])  # the requests' own latent tokens
        self.device, self.dtype = device, dtype
        self.text_cache: dict = {}  # the text refiner's output, made by the first step

    def sigmas(self, sigma: float) -> torch.Tensor:
        """``sigma`` for every packed sample, on the device."""
        return torch.full((len(self.layout.img_len),), sigma, dtype=torch.float32, device=self.device)

    def velocity(self, model: MOSSImageTransformer, x: torch.Tensor, s: torch.Tensor,
                 skip_layers: Sequence[int]) -> torch.Tensor:
        """The guided velocity (fp32) of the requests' latent tokens ``x`` (packed, in
        request order) at the packed samples' noise levels ``s`` (``sigmas``). The text
        refiner's output is made once and kept where no engine runs around the model
        (``engines.text_reusable``)."""
        z = torch.cat([x, x]) if self.skip is not None else x
        replace = skipping(skip_layers, self.skip) if self.skip is not None else {}
        with torch.no_grad():
            refined = self.text_cache.get("refined")
            if refined is None and model.engines.text_reusable():
                refined = self.text_cache["refined"] = model.refine_text(self.text, self.layout)
            v = model(z.to(self.dtype), self.text, s, self.layout, refined=refined,
                      replace=replace).float()
        if self.skip is None:
            return v
        p, u = v[:self.n_img], v[self.n_img:]
        return u + self.cfg * (p - u)


def skipping(layers: Iterable[int], samples: torch.Tensor | Sequence[bool] | None = None
             ) -> dict[int, Replacement]:
    """The joint blocks ``layers`` skipped (their input passed on), for every sample, or with
    ``samples`` (bool [B]: a tensor, or a host sequence) only for those samples: the others
    run the block (the CFG negative branch packed with the positive one), as
    ``MOSSImageTransformer.forward``'s ``replace``. Where the skipped samples are the last
    ones (known on the host: the sampler's negatives), a skipped layer runs on the leading
    samples' tokens alone; else on every token, the skipped samples' kept (attention stays
    within a sample: exact for the others)."""
    layers = set(layers)
    if samples is None:
        return {n: _passed for n in layers}
    lead = _leading(samples)
    run = functools.partial(_on_leading, lead) if lead is not None else \
        functools.partial(_on_kept, torch.as_tensor(samples, dtype=torch.bool))
    return {n: run for n in layers}


def _passed(block, x, mod, rope, layout, ops):
    return x


def _on_leading(lead: int, block, x, mod, rope, layout, ops):
    if not lead:
        return x
    P = sum(layout.joint_len[:lead])
    return torch.cat([block(x[:P], mod, layout.seg_joint[:P], tuple(r[:P] for r in rope),
                            layout.joint_len[:lead], ops), x[P:]])


def _on_kept(skip_B: torch.Tensor, block, x, mod, rope, layout, ops):
    keep = skip_B.to(x.device)[layout.seg_joint][:, None]
    return torch.where(keep, x, block(x, mod, layout.seg_joint, rope, layout.joint_len, ops))


def _leading(skip_samples) -> int | None:
    """How many samples lead ``skip_samples`` unskipped when every skipped one comes after
    them, read on the host (a sequence, or a CPU tensor); else None (a device tensor is
    never read back: that would wait for the device)."""
    if isinstance(skip_samples, torch.Tensor):
        if skip_samples.device.type != "cpu":
            return None
        skip_samples = skip_samples.tolist()
    flags = [bool(f) for f in skip_samples]
    lead = flags.index(True) if True in flags else len(flags)
    return lead if all(flags[lead:]) else None


def velocity(model: MOSSImageTransformer, x: list[torch.Tensor], reqs: Sequence[Request],
             sigma: float, cfg: float, skip_layers: Sequence[int], device, dtype) -> list[torch.Tensor]:
    """The guided velocity of each request's current latent tokens (fp32)."""
    packed = Packed(reqs, cfg, device, dtype)
    v = packed.velocity(model, torch.cat(x).to(device), packed.sigmas(sigma), skip_layers)
    return list(v.split([len(xi) for xi in x]))


class GraphedVelocity:
    """``Packed.velocity`` captured once in a CUDA graph and replayed every later step: the
    ~2000 kernels of a forward launch as one, with no host work between them.

    The first call runs the forward eagerly (a real step, which also does the lazy set-up
    capture cannot: kernel builds, library handles and workspaces of the stream) and then
    captures it, so the capture's host work overlaps that step on the device and no forward
    is spent on warming up. Capture goes straight to ``capture_begin``: ``torch.cuda.graph``
    would synchronize the device and empty the allocator's caches first. The latents and
    noise levels live in the graph's own input tensors; a call copies them in (device to
    device), replays and returns the graph's output tensor (overwritten by the next call).
    Same kernels on the same inputs as the eager forward: the same numbers. Calls must come
    on a side stream (``sample`` runs the loop on one): capture cannot use the default
    stream. A capture that fails leaves the eager forward in place, said once."""

    def __init__(self, model: MOSSImageTransformer, packed: Packed, skip_layers: Sequence[int]):
        self.model, self.packed, self.skip = model, packed, skip_layers
        self.graph: torch.cuda.CUDAGraph | None = None
        self.failed = False

    def eager(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return self.packed.velocity(self.model, x, s, self.skip)

    def __call__(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        if self.graph is not None:
            self.x.copy_(x)
            self.s.copy_(s)
            self.graph.replay()
            return self.v
        v = self.eager(x, s)
        if not self.failed:
            self._capture(x, s)
        return v

    def _capture(self, x: torch.Tensor, s: torch.Tensor) -> None:
        self.x, self.s = x.clone(), s.clone()
        graph = torch.cuda.CUDAGraph()
        try:
            graph.capture_begin()
            try:
                self.v = self.eager(self.x, self.s)
            finally:
                graph.capture_end()
        except Exception as e:  # an op that cannot be captured: the eager forward
            self.failed = True
            log.warning("sampling without a CUDA graph: capturing the forward failed (%s: %s)",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return
        self.graph = graph


def sample(model: MOSSImageTransformer, reqs: Sequence[Request], steps: int = 50, cfg: float = 3.0,
           shift: float = 5.0, skip_layers: Sequence[int] | None = None, device="cpu",
           dtype: torch.dtype = torch.float32, callback: Callable[[int, int], None] | None = None,
           cuda_graph: bool = False) -> list[torch.Tensor]:
    """Latent tokens ``[h*w, 128]`` (fp32) of each request, sampled from its own noise.
    ``cuda_graph`` (CUDA only): capture the forward once and replay it every step
    (``GraphedVelocity``); a capture that fails falls back to the eager forward, said once."""
    skip = model.config.negative_skip_layers if skip_layers is None else tuple(skip_layers)
    bad = [n for n in skip if not 0 <= n < model.config.depth]
    if bad:
        raise ValueError(f"skip layers {bad} are outside [0, {model.config.depth})")
    sigmas = inference_sigmas(steps, shift).tolist()
    noise = [initial_noise(r.seed, r.hw, model.config.latent_channels) for r in reqs]
    packed = Packed(reqs, cfg, device, dtype)
    x = torch.cat(noise).to(device)
    levels = [packed.sigmas(sig) for sig in sigmas[:-1]]  # made now: no host work per step

    graphed = GraphedVelocity(model, packed, skip)
    side = None
    if cuda_graph and x.device.type == "cuda" and len(levels) > 1:
        side = torch.cuda.Stream(x.device)  # capture needs a stream of its own; the loop runs there
        side.wait_stream(torch.cuda.current_stream(x.device))
    velocity = graphed if side is not None else graphed.eager
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for i in range(len(sigmas) - 1):
            x = x + (sigmas[i + 1] - sigmas[i]) * velocity(x, levels[i])
            if callback:
                callback(i + 1, len(sigmas) - 1)
    if side is not None:
        torch.cuda.current_stream(x.device).wait_stream(side)
    return [xi.clone() for xi in x.cpu().split([len(n) for n in noise])]
