"""GPU benchmark of the frozen encoders at their real configurations, random weights.

    PYTHONPATH=. python bench/bench_encoders.py [--captions 256] [--images 32]

Text: the Qwen3.5-9B text configuration (32 layers: 24 Gated DeltaNet + 8 full attention,
hidden 4096) in bf16 with random weights, encoding ``captions`` captions through
``TextEncoder.encode`` (batches of 32, 16k padded tokens per call). No MOSS tokenizer can
be loaded here, so the byte-level tiny tokenizer stands in, with caption strings sized so
each templated caption is 112 tokens, the length an ~80-word caption has under the Qwen
tokenizer (80 words ~ 100 BPE tokens + 12 template tokens). VAE: the published FLUX.2 VAE
configuration in bf16 with random weights, encoding 1024x1024 images
(``VAE.encode_batches``, 4 images per call), then decoding them. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import time

import torch

from kohakumoss.encoders import VAE, TextEncoder, tiny_tokenizer
from kohakumoss.encoders.text import ENCODER_ID, build_model, text_config
from _report import report  # bench/_report.py (the script's folder is on sys.path)


def cuda_time(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def bench_text(n: int, tokens: int) -> dict:
    cfg = text_config({})  # Qwen3.5-9B defaults (+ its rope constants)
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in qwen.Qwen3_5TextModel(cfg).named_parameters()}
    g = torch.Generator("cuda").manual_seed(0)

    def get(name: str) -> torch.Tensor:
        if "linear_attn.norm" in name:  # the gated norm has an ordinary weight
            return torch.ones(shapes[name], device="cuda")
        if name.endswith("norm.weight"):  # zero-centred norms: w = 0 is the identity scale
            return torch.zeros(shapes[name], device="cuda")
        return torch.randn(shapes[name], device="cuda", generator=g) * 0.02

    torch.cuda.reset_peak_memory_stats()
    model = build_model(cfg, list(shapes), get, torch.bfloat16, torch.device("cuda"), "bench")
    enc = TextEncoder(model, tiny_tokenizer(), ENCODER_ID)
    overhead = len(enc.token_ids([""])[0])
    words = ("a girl with long silver hair stands in a quiet field of flowers under soft light " * 40)
    captions = [f"{i:04d} " + words[: tokens - overhead - 5] for i in range(n)]
    assert all(len(t) == tokens for t in enc.token_ids(captions))
    enc.encode(captions[:32])  # warm-up
    dt, out = cuda_time(lambda: enc.encode(captions, batch=32, max_tokens=16384))
    assert len(out) == n and tuple(out[0].shape) == (tokens, 4096)
    return {"captions": n, "tokens_per_caption": tokens, "seconds": dt, "captions_per_s": n / dt,
            "tokens_per_s": n * tokens / dt, "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "params": sum(p.numel() for p in model.parameters())}


def bench_vae(n: int) -> dict:
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(0)
    model = AutoencoderKLFlux2()  # the published FLUX.2 VAE configuration, random weights
    vae = VAE(model.to("cuda", torch.bfloat16), torch.bfloat16, torch.device("cuda"), "flux2-vae")
    pixels = [torch.rand(3, 1024, 1024, device="cuda") * 2 - 1 for _ in range(n)]
    vae.encode_batches(pixels[:4], batch=4)  # warm-up
    torch.cuda.reset_peak_memory_stats()
    dt, tokens = cuda_time(lambda: vae.encode_batches(pixels, batch=4))
    enc_peak = torch.cuda.max_memory_allocated() / 2**30
    latents = torch.stack([t.T.reshape(128, 64, 64) for t in tokens[:4]])
    vae.decode(latents[:1])
    torch.cuda.reset_peak_memory_stats()
    ddt, _ = cuda_time(lambda: [vae.decode(latents[i:i + 1]) for i in range(4)])
    return {"images": n, "size": "1024x1024", "encode_s": dt, "images_per_s": n / dt,
            "encode_peak_gib": enc_peak, "decode_images_per_s": 4 / ddt,
            "decode_peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--captions", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=112)
    ap.add_argument("--images", type=int, default=32)
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "vae": bench_vae(a.images)}
    torch.cuda.empty_cache()
    res["text"] = bench_text(a.captions, a.tokens)
    report(res, "bench_encoders")


if __name__ == "__main__":
    main()
