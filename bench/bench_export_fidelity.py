"""How exactly the bf16 export files reproduce every algorithm, and what they weigh (not a test).

    python bench/bench_export_fidelity.py [--markdown] [--no-moss]

Per algorithm and variant, on the tiny DiT (preset ``all``, r = 4, alpha = 2, every factor
moved off its init, as in tests/test_export_fidelity.py), the largest per-weight relative
error, at strengths 1 and 0.5, of:

- ``comfy``: the bf16 ComfyUI file (fused q/k/v, the default) as ComfyUI patches it in float32
  (``comfy_semantics``, run in float64), against kmoss's strength rule (``s dW``), or
  ComfyUI's own slider rule for native OFT/BOFT blocks (``slider gap`` says how far that is
  from ``s dW``);
- ``lycoris``: the bf16 LyCORIS file loaded by kmoss (``load_adapter_file``, merged at s),
  against the trained adapter merged at s;
- ``fp16 patch``: the bf16 ComfyUI file patched in float16 (ComfyUI's low-VRAM path), error
  of the patched weight against the exact one; ``fp16 floor`` is float16's own rounding of
  the exact weight. ``failed`` counts the patches ComfyUI cannot apply in float16.

File sizes, before (every tensor in the file dtype, as kohakumoss wrote them until the
per-tensor dtypes) and after: the tiny model's files, and one joint block at MOSS-Image width
(dim 3072, ffn 8192, preset ``attn-mlp``, r = 32; tensor bytes, fused q/k/v) with ``--moss``.
The numbers and the commit go into docs/exports.md (#export-fidelity).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from kohakumoss.adapters import merged_weight
from kohakumoss.export.cases import ALGOS, CASES, trained_case
from kohakumoss.export.check import trained_deltas
from kohakumoss.formats.comfy import (comfy_state_dict, comfy_strength_delta, layer_delta,
                                      load_adapter_file)
from kohakumoss.formats.comfy_semantics import load_patches, rel_error, verify
from kohakumoss.formats.keys import fuse_qkv
from kohakumoss.formats.lycoris import lycoris_state_dict
from kohakumoss.model.build import random_transformer, tiny_transformer
from kohakumoss.model.config import FLAVORS

sys.path.insert(0, str(Path(__file__).parent))
from _report import report  # noqa: E402

AS_DIFF = {"oft-as-diff": "oft", "boft-as-diff": "boft"}  # export rotations "diff"
STRENGTHS = (1.0, 0.5)


def lycoris_error(aset, model, tensors, strength: float) -> float:
    """The LyCORIS file loaded by kmoss at ``strength`` against the adapter merged there."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "a.safetensors"
        save_file(tensors, str(path))
        fresh = tiny_transformer().float().eval()
        fresh.load_state_dict(model.state_dict())
        base = {k: v.clone() for k, v in fresh.state_dict().items()}
        handle = load_adapter_file(fresh, path, strength, "merge")
        got = fresh.state_dict()
        worst = 0.0
        for p, lyco in aset.modules.items():
            W, b = merged_weight(lyco, strength)
            worst = max(worst, rel_error(got[f"{p}.weight"] - base[f"{p}.weight"],
                                         W - base[f"{p}.weight"]))
        for p, n in aset.norms.items():
            worst = max(worst, rel_error(got[f"{p}.weight"] - base[f"{p}.weight"],
                                         n.merged_weight(strength) - base[f"{p}.weight"]))
        handle.remove()
    return worst


def comfy_errors(aset, tensors, base_fused, strength: float) -> dict:
    patches, _ = load_patches(tensors, base_fused)
    blocks = frozenset(n for n, q in patches.items() if q.kind in ("oft", "boft"))
    want = trained_deltas(aset, True, strength, blocks)
    rows, unloaded = verify(tensors, base_fused, want, strength)
    half, _ = verify(tensors, base_fused, want, strength, torch.float16)
    floor = max(rel_error((base_fused[k].double() + want[k].double()).half(),
                          base_fused[k].double() + want[k].double()) for k in want)
    gap = max((rel_error(comfy_strength_delta(aset.modules[n[:-7]], strength, True),
                         strength * layer_delta(aset.modules[n[:-7]])[0]) for n in blocks),
              default=0.0)
    return {"comfy": max(r.rel_error for r in rows), "unloaded": len(unloaded),
            "fp16_patch": max(r.rel_error for r in half),
            "fp16_failed": sum(bool(r.note) for r in half), "fp16_floor": floor,
            "slider_gap": gap}


def file_bytes(tensors: dict[str, torch.Tensor], uniform: torch.dtype | None = None) -> int:
    """Bytes of the safetensors file; ``uniform``: every ndim > 0 float cast to it (before)."""
    if uniform is not None:
        tensors = {k: v.to(uniform) if v.is_floating_point() and v.ndim else v
                   for k, v in tensors.items()}
    with tempfile.TemporaryDirectory() as tmp:
        save_file(tensors, str(Path(tmp) / "f.safetensors"))
        return (Path(tmp) / "f.safetensors").stat().st_size


def tensor_bytes(tensors: dict[str, torch.Tensor], uniform: torch.dtype | None = None) -> int:
    size = 0
    for v in tensors.values():
        dt = uniform if uniform is not None and v.is_floating_point() and v.ndim else v.dtype
        size += v.numel() * torch.empty((), dtype=dt).element_size()
    return size


def measure(case: str) -> dict:
    algo, kw = CASES[AS_DIFF.get(case, case)]
    model, aset = trained_case(algo, kw)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    comfy, _ = comfy_state_dict(aset, model, fused_qkv=True, dtype=torch.bfloat16,
                                rotations="diff" if case in AS_DIFF else "blocks")
    lyco = lycoris_state_dict(aset, torch.bfloat16)
    res = {"case": case}
    for s in STRENGTHS:
        res[f"s{s:g}"] = {**comfy_errors(aset, comfy, fuse_qkv(base), s),
                          "lycoris": lycoris_error(aset, model, lyco, s)}
    res["bytes"] = {"comfy_before": file_bytes(comfy, torch.bfloat16),
                    "comfy_after": file_bytes(comfy),
                    "lycoris_before": file_bytes(lyco, torch.bfloat16),
                    "lycoris_after": file_bytes(lyco)}
    return res


def moss_sizes(case: str) -> dict:
    """Tensor bytes of one joint block's files at MOSS-Image width (r = 32, attn-mlp)."""
    algo, kw = CASES[AS_DIFF.get(case, case)]
    kw = {**kw, "dim": 32, "alpha": 16.0}
    config = dataclasses.replace(FLAVORS["base"], depth=1, text_blocks=0, negative_skip_layers=())
    model, aset = trained_case(algo, kw, random_transformer(config, "cpu").eval(), preset="attn-mlp")
    comfy, _ = comfy_state_dict(aset, model, fused_qkv=True, dtype=torch.bfloat16,
                                rotations="diff" if case in AS_DIFF else "blocks")
    lyco = lycoris_state_dict(aset, torch.bfloat16)
    return {"case": case, "comfy_before": tensor_bytes(comfy, torch.bfloat16),
            "comfy_after": tensor_bytes(comfy), "lycoris_before": tensor_bytes(lyco, torch.bfloat16),
            "lycoris_after": tensor_bytes(lyco)}


def markdown(rows: list[dict], moss: list[dict]) -> str:
    out = ["| algorithm | comfy s=1 | comfy s=0.5 | lycoris s=1 | lycoris s=0.5 | fp16 patch s=1 "
           "| fp16 patch s=0.5 | fp16 floor | slider gap s=0.5 | comfy bytes before -> after "
           "| lycoris bytes before -> after |", "|" + " --- |" * 11]
    for r in rows:
        a, h, b = r["s1"], r["s0.5"], r["bytes"]
        fail = f" ({a['fp16_failed']} not applied)" if a["fp16_failed"] else ""
        gap = f"{h['slider_gap']:.1%}" if h["slider_gap"] else "0"
        out.append(f"| {r['case']} | {a['comfy']:.2e} | {h['comfy']:.2e} | {a['lycoris']:.2e} "
                   f"| {h['lycoris']:.2e} | {a['fp16_patch']:.2e}{fail} | {h['fp16_patch']:.2e} "
                   f"| {a['fp16_floor']:.1e} | {gap} | {b['comfy_before']} -> {b['comfy_after']} "
                   f"| {b['lycoris_before']} -> {b['lycoris_after']} |")
    if moss:
        out += ["", "| algorithm (MOSS width, one block) | comfy MiB before -> after | lycoris MiB "
                "before -> after |", "| --- | --- | --- |"]
        mib = 2.0**20
        for m in moss:
            out.append(f"| {m['case']} | {m['comfy_before'] / mib:.2f} -> "
                       f"{m['comfy_after'] / mib:.2f} | {m['lycoris_before'] / mib:.2f} -> "
                       f"{m['lycoris_after'] / mib:.2f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--markdown", action="store_true", help="Also print the docs table.")
    ap.add_argument("--moss", action="store_true", help="Sizes of one MOSS-width block too.")
    a = ap.parse_args()
    rows = [measure(c) for c in [*CASES, *AS_DIFF]]
    moss = [moss_sizes(c) for c in [*ALGOS, *AS_DIFF]] if a.moss else []
    report({"tiny": rows, "moss_block": moss}, "export_fidelity")
    if a.markdown:
        print(markdown(rows, moss))


if __name__ == "__main__":
    main()
