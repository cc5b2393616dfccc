"""Velocity error of each forward precision against fp32, at MOSS-Image's published size.

    python bench/bench_precision.py [--side 1024] [--massive 30000] [--seed 0] [--grads | --grads-only]
                                    [--params bench/train.yaml] [-S adapter.dim=64 ...]

Random weights (the reference's init, N(0, 0.02)), one 1 MP sample with a 128-token caption,
sigma 0.5. At that init the blocks' gates are ~0 and the blocks barely touch the output, so
``--gate`` (default 1) is added to the gates' modulation bias: every block then writes into
the stream as a trained one does. Each row casts (and for the weight-only rows first
quantizes, per output row, the blocks' linear weights) a copy of the fp32 model and runs the
same batch; the error is ``||v - v_fp32|| / ||v_fp32||`` over the velocity.

``--massive X``: every block also adds X to four channels of the stream, as the few
"massive activation" channels of real DiTs grow down the 42 blocks (random weights alone
keep the stream small); the sum passes fp16's 65504 when X > 1560. The largest magnitude the
stream reaches is printed per run (docs/precision.md).
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

from kohakumoss.model.build import random_transformer
from kohakumoss.model.config import FLAVORS
from kohakumoss.model.dit import cast_model
from kohakumoss.model.engines import Handle
from kohakumoss.model.layout import build_layout

FP8_MAX = 448.0


def quantize_rows(w: torch.Tensor, kind: str) -> torch.Tensor:
    """``w`` through per-row int8 or fp8 e4m3 codes and back (fp32)."""
    amax = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    if kind == "int8":
        scale = amax / 127.0
        return (w / scale).round().clamp(-127, 127) * scale
    scale = amax / FP8_MAX
    return (w / scale).to(torch.float8_e4m3fn).float() * scale


def stream_hooks(model, massive: float) -> list[float]:
    """Hooks adding ``massive`` to four channels of every block's output (times the stream's
    scale) and recording the largest |value| the stream reaches; registered on the model's
    engine registry (its blocks then run whole, so each block's output is the stream)."""
    peak = [0.0]

    def hook(block, _i, out):
        if massive:
            out = out.clone()
            out[:, :4] += massive * block.stream_scale
        peak[0] = max(peak[0], float(out.detach().abs().float().max()))
        return out

    old = model.engines.get("stream probe")
    if old is not None:  # a second run of the same model: the new hooks replace the old
        model.engines.remove(old)
    hooks = [block.register_forward_hook(hook) for block in model.layers]
    model.engines.register(Handle("stream probe", blocks=tuple(model.layers),
                                  undo=lambda: [h.remove() for h in hooks]))
    return peak


def grad_rows(ref, img, txt, sigma, layout, dev, adapter) -> None:
    """``--grads``: the params' adapter's gradients (``bench/train.yaml``: a rank-32 LoRA) (of ``<v, r>`` for a fixed random r) under
    bf16, fp8 compute (``on``: bf16 input gradients) and ``full`` (fp8 input gradients;
    and ``fast``, those GEMMs accumulating fast), against the fp32 model's: ``||g - g_fp32|| / ||g_fp32||`` over all LoRA
    parameters."""
    from kohakumoss.adapters import apply_adapters
    from kohakumoss.quant.plan import decode
    from kohakumoss.precision import precision_policy
    from kohakumoss.training.engines import EnginePlan, apply_engines

    r = torch.randn(img.shape, device=dev, generator=torch.Generator(device=dev).manual_seed(7))

    def grads(base: str, fp8: str, dtype: torch.dtype) -> torch.Tensor:
        m = copy.deepcopy(ref).to(dev)  # the fp32 model may be held on the host (--ref-on-host)
        if base != "keep":
            policy = precision_policy("bf16", full=False, **decode(base, fp8).policy_args())
            apply_engines(m, EnginePlan(dev, policy))
        cast_model(m, dtype)
        aset = apply_adapters(m, adapter, seed=0)
        params = list(aset.trainable_parameters())
        with torch.no_grad():
            for p in params:  # up matrices not zero: every gradient flows
                p.copy_(torch.randn(p.shape, device=dev, generator=torch.Generator(device=dev).manual_seed(p.numel())) * 0.01)
        (m(img.to(dtype), txt.to(dtype), sigma, layout).float() * r).sum().backward()
        out = torch.cat([p.grad.float().flatten() for p in params])
        del m, aset
        torch.cuda.empty_cache()
        return out

    g32 = grads("keep", "off", torch.float32)
    for name, base, fp8 in [("bf16", "keep", "off"), ("fp8 compute on (bf16 input gradients)", "fp8", "on"),
                            ("fp8 compute full (fp8 input gradients, promoted sums)", "fp8", "full"),
                            ("fp8 compute fast (full, its input gradients fast-accumulated)", "fp8", "fast")]:
        err = float((grads(base, fp8, torch.bfloat16) - g32).norm() / g32.norm())
        print(json.dumps({"lora_grad_rel_error": err, "precision": name}))


def main() -> None:
    from bench_train import PARAMS, bench_params

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=Path, default=PARAMS, help="a params file (its adapter: --grads)")
    ap.add_argument("-S", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="section.key=value over the params file (repeatable), e.g. adapter.dim=64")
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--text", type=int, default=128)
    ap.add_argument("--massive", type=float, default=0.0)
    ap.add_argument("--gate", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--flavor", default="base", help="tiny: a quick check of the script on the CPU")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--grads", action="store_true",
                    help="also the LoRA gradients' error of bf16, fp8 compute on, full and fast")
    ap.add_argument("--grads-only", action="store_true", help="only the --grads rows (no forward rows)")
    ap.add_argument("--ref-on-host", choices=["auto", "on", "off"], default="auto",
                    help="hold the fp32 model in host memory, each variant copied to the card: "
                         "the fp32 --grads row then fits an 80 GB card (auto: on below 100 GiB)")
    a = ap.parse_args()
    p = bench_params(a.params, a.overrides)
    dev = torch.device(a.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    config = FLAVORS[a.flavor]
    ref = random_transformer(config, dev, seed=a.seed).eval()
    D = config.dim
    with torch.no_grad():
        for chunk in (2, 5):  # gate_a, gate_f of the [6, D] block modulation
            ref.shared_block_modulation.bias[chunk * D:(chunk + 1) * D] += a.gate
    small = dev.type == "cuda" and torch.cuda.get_device_properties(dev).total_memory < 100 * 2**30
    if a.ref_on_host == "on" or (a.ref_on_host == "auto" and small):
        ref = ref.cpu()  # 20 GiB at the published size: with its copy and a fp32 backward > 80
        torch.cuda.empty_cache()
    g = torch.Generator(device=dev).manual_seed(a.seed + 1)
    h = w = a.side // 16
    img = torch.randn(h * w, config.latent_channels, device=dev, generator=g)
    txt = torch.randn(a.text, config.text_dim, device=dev, generator=g)
    sigma = torch.tensor([0.5], device=dev)
    layout = build_layout([(h, w)], [a.text]).to(dev)

    def run(model, scale: float = 1.0):
        model.set_stream_scale(scale)
        peak = stream_hooks(model, a.massive)
        with torch.no_grad():
            v = model(img, txt, sigma, layout).float()
        return v, peak[0] / scale

    if a.grads_only:
        grad_rows(ref, img, txt, sigma, layout, dev, p.adapter)
        return
    v32, peak32 = run(copy.deepcopy(ref).to(dev))
    rows = [{"precision": "fp32", "rel_error": 0.0, "finite": True, "stream_peak": peak32}]
    variants = [("bf16", torch.bfloat16, None, 1.0), ("fp16 + stream scale 2^-8", torch.float16, None, 2.0 ** -8),
                ("fp16, no stream scale", torch.float16, None, 1.0),
                ("int8 weight-only (per row) + bf16", torch.bfloat16, "int8", 1.0),
                ("fp8 e4m3 weight-only (per row) + bf16", torch.bfloat16, "fp8", 1.0),
                # the training engines' quantized base: codes held, the kernels of the op table
                ("precision.base int8 (Triton kernel)", torch.bfloat16, "base:int8", 1.0),
                ("precision.base fp8 (Triton kernel)", torch.bfloat16, "base:fp8", 1.0),
                ("fp8 compute (torch._scaled_mm)", torch.bfloat16, "base:fp8-compute", 1.0)]
    for name, dtype, quant, scale in variants:
        m = copy.deepcopy(ref).to(dev)  # the fp32 model may be held on the host (--ref-on-host)
        if quant and quant.startswith("base:"):
            from kohakumoss.precision import precision_policy
            from kohakumoss.training.engines import EnginePlan, apply_engines

            base = quant.removeprefix("base:")
            policy = precision_policy("bf16", full=False, base=base.removesuffix("-compute"),
                                      fp8_compute=base == "fp8-compute")
            from kohakumoss.quant.linear import quantized_ops

            applied = apply_engines(m, EnginePlan(dev, policy))
            print(applied.quantized, quantized_ops(m).names())
        elif quant:
            with torch.no_grad():
                for block in m.layers:
                    for lin in block.modules():
                        if isinstance(lin, torch.nn.Linear) and lin.weight.ndim == 2:
                            lin.weight.copy_(quantize_rows(lin.weight.float(), quant))
        cast_model(m, dtype)
        v, peak = run(m, scale)
        finite = bool(torch.isfinite(v).all())
        err = float((v - v32).norm() / v32.norm()) if finite else float("nan")
        rows.append({"precision": name, "rel_error": err, "finite": finite, "stream_peak": peak})
        del m
        torch.cuda.empty_cache()
    if a.grads:
        grad_rows(ref, img, txt, sigma, layout, dev, p.adapter)
    bf16 = rows[1]["rel_error"]
    for r in rows:
        ratio = r["rel_error"] / bf16 if bf16 and r["finite"] else float("nan")
        print(f"{r['precision']:40s} rel. error {r['rel_error']:.3e}  x bf16 {ratio:6.2f}  "
              f"finite {r['finite']!s:5s}  stream peak {r['stream_peak']:.3g}")
    print(json.dumps({"side": a.side, "gate": a.gate, "massive": a.massive, "rows": rows}))


if __name__ == "__main__":
    main()
