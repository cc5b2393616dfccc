"""The frozen Qwen3.5 text encoder (docs/encoders.md#text-encoder,
docs/encoders.md#cache-keys): template, batching, layouts."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import transformers.models.qwen3_5.modeling_qwen3_5 as qwen
from kohakumoss.data.tokens import TokenCounter
from kohakumoss.encoders import TextEncoder, TextEncoderError, tiny_tokenizer
from kohakumoss.precision.dtypes import dtype_name, resolve_dtype
from kohakumoss.encoders.text import (group_longest_first, infer_config, tiny_config,
                                      tiny_state_dict, torch_linear_attention_ops)
from kohakumoss.precision.quant import encode_format, quantize_fp8, quantize_int8

CAPTIONS = ["a cat", "", "1girl, solo, long hair, looking at viewer, " * 6, "日本語のキャプション, ümlaut",
            "x", "a very long caption about a landscape with mountains, rivers and a sunset. " * 4]
TEMPLATE = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n<think>\n"


@pytest.fixture(scope="module")
def enc() -> TextEncoder:
    return TextEncoder.load("tiny", dtype="fp32")


@pytest.fixture(scope="module")
def single(enc) -> list[torch.Tensor]:
    return [enc.encode([c])[0] for c in CAPTIONS]


@pytest.fixture(scope="module")
def batched(enc) -> list[torch.Tensor]:
    return enc.encode(CAPTIONS)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, enc) -> Path:
    """An HF-style pipeline root: text_encoder/ (save_pretrained) + tokenizer/."""
    root = tmp_path_factory.mktemp("pipeline")
    enc.model.save_pretrained(root / "text_encoder")
    enc.tokenizer.save_pretrained(root / "tokenizer")
    return root


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor], atol: float = 0.0) -> None:
    assert [x.shape for x in a] == [y.shape for y in b]
    assert max((x - y).abs().max().item() for x, y in zip(a, b)) <= atol


def test_tiny_template_renders_qwen35_shape(enc):
    assert enc.render("a cat") == TEMPLATE.format("a cat")
    tok = tiny_tokenizer()
    off = tok.apply_chat_template([{"role": "user", "content": "a"}], tokenize=False,
                                  add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    empty = enc.token_ids([""])[0]
    assert 0 < len(empty) == len(tok(TEMPLATE.format(""), add_special_tokens=False)["input_ids"])
    specials = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<think>"])
    assert empty[0] == specials[0] and empty[-2] == specials[2] and specials[1] in empty
    assert tok.decode(enc.token_ids([CAPTIONS[3]])[0]) == TEMPLATE.format(CAPTIONS[3])  # bytes round-trip
    assert len(tok) < 300 and tok.pad_token == "<|endoftext|>" and tiny_tokenizer() is tok


def test_output_shapes_dtype_and_lengths(enc, single):
    lengths = [len(i) for i in enc.token_ids(CAPTIONS)]
    assert [tuple(h.shape) for h in single] == [(n, 48) for n in lengths]
    assert all(h.dtype == torch.float32 and h.device.type == "cpu" for h in single)
    assert enc.encode([]) == [] and enc.token_ids([]) == []
    assert enc.hidden_size == 48 and not any(p.requires_grad for p in enc.model.parameters())
    bf16 = TextEncoder.load("tiny")
    assert bf16.dtype == torch.bfloat16 and bf16.encode(["a cat"])[0].dtype == torch.bfloat16


@pytest.mark.parametrize("batch,max_tokens", [(1, 16384), (3, 16384), (32, 16384), (32, 200), (4, 1)])
def test_batched_equals_single(enc, single, batch, max_tokens):
    # not bit-exact on CPU: softplus / exp / silu kernels round the vectorised body and the
    # scalar tail of a tensor differently (1 ulp), so a token's value depends on the row
    # length; the float64 test below shows the padding itself is exact
    assert_same(enc.encode(CAPTIONS, batch=batch, max_tokens=max_tokens), single, atol=5e-5)


def test_right_padding_is_exact_in_float64():
    enc64 = TextEncoder.load("tiny", dtype="fp32")
    enc64.model.double()
    alone = [enc64.encode([c])[0] for c in CAPTIONS]
    assert_same(enc64.encode(CAPTIONS, batch=32), alone, atol=1e-12)


def test_grouping_longest_first_with_caps():
    lengths = [5, 50, 20, 20, 300, 1]
    assert group_longest_first(lengths, 32, 0) == [[4, 1, 2, 3, 0, 5]]
    assert group_longest_first(lengths, 2, 0) == [[4, 1], [2, 3], [0, 5]]
    assert group_longest_first(lengths, 32, 100) == [[4], [1, 2], [3, 0, 5]]  # 300 alone, over cap
    with pytest.raises(TextEncoderError):
        group_longest_first(lengths, 0, 0)


def test_truncation_at_max_length(enc, single, monkeypatch):
    monkeypatch.setattr(enc, "max_length", 12)
    ids = enc.token_ids(CAPTIONS)
    assert all(len(i) == 12 for i in ids)  # every templated caption is longer than 12 tokens
    out = enc.encode(CAPTIONS)
    assert all(h.shape == (12, 48) for h in out)
    assert_same(out, [h[:12] for h in single], atol=5e-5)  # causal: a truncated prompt = a prefix


def test_tiny_model_is_deterministic_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a, b = TextEncoder.load("tiny", dtype="fp32"), TextEncoder.load("tiny", dtype="fp32")
    assert torch.equal(state, torch.get_rng_state())
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    types = tiny_config().layer_types
    assert {"linear_attention", "full_attention"} <= set(types)


def test_infer_config_recovers_the_tiny_config():
    ref = tiny_config()
    got = infer_config({k: tuple(v.shape) for k, v in tiny_state_dict(ref).items()})
    fields = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "layer_types",
              "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
              "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
              "linear_conv_kernel_dim", "rope_parameters", "rms_norm_eps", "attention_bias"]
    assert {f: getattr(got, f) for f in fields} == {f: getattr(ref, f) for f in fields}


def test_hf_pipeline_root_and_folder_load_identically(enc, single, batched, pipeline):
    for path in (pipeline, pipeline / "text_encoder"):
        loaded = TextEncoder.load(str(path), dtype="fp32")
        assert loaded.key_id == "qwen3.5-9b/fp32/compute"
        assert_same(loaded.encode(CAPTIONS), batched)
    # our meta-device loader equals transformers' own from_pretrained
    ref = qwen.Qwen3_5TextModel.from_pretrained(str(pipeline / "text_encoder"), dtype=torch.float32)
    ids = torch.tensor(enc.token_ids([CAPTIONS[0]]))
    with torch.inference_mode(), torch_linear_attention_ops(torch.device("cpu")):
        want = ref(input_ids=ids, use_cache=False).last_hidden_state[0]
    assert torch.equal(want, single[0])


def test_multimodal_folder_uses_the_language_model_only(tmp_path, batched, pipeline):
    folder = tmp_path / "text_encoder"
    folder.mkdir()
    text = json.loads((pipeline / "text_encoder" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_5", "text_config": text, "vision_config": {"depth": 1}}))
    sd = {f"model.language_model.{k}": v for k, v in tiny_state_dict(tiny_config()).items()}
    sd |= {"model.visual.blocks.0.attn.qkv.weight": torch.ones(3, 3), "lm_head.weight": torch.ones(2, 48),
           "mtp.embed_tokens.weight": torch.ones(2, 48), "mtp.norm.weight": torch.ones(48),
           "mtp.layers.0.mlp.up_proj.weight": torch.ones(2, 48)}  # the MTP head is not the text model
    save_file(sd, str(folder / "model.safetensors"))
    (tmp_path / "tokenizer").mkdir()
    tiny_tokenizer().save_pretrained(tmp_path / "tokenizer")
    assert_same(TextEncoder.load(str(tmp_path), dtype="fp32").encode(CAPTIONS), batched)


@pytest.mark.parametrize("prefix", ["model.language_model.", "model.", "language_model.", ""])
@pytest.mark.parametrize("config", ["next_to_file", "tokenizer_folder", "inferred"])
def test_comfy_single_file(tmp_path, batched, pipeline, prefix, config):
    sd = {prefix + k: v for k, v in tiny_state_dict(tiny_config()).items()}
    file = tmp_path / "text_encoders" / "qwen35.safetensors"
    file.parent.mkdir()
    save_file(sd, str(file))
    tok = tmp_path / "tok"
    tiny_tokenizer().save_pretrained(tok)
    if config != "inferred":
        target = file.parent if config == "next_to_file" else tok
        (target / "config.json").write_text((pipeline / "text_encoder" / "config.json").read_text())
    loaded = TextEncoder.load(str(file), tokenizer=str(tok), dtype="fp32")
    assert loaded.key_id == "qwen3.5-9b/fp32/compute"
    assert_same(loaded.encode(CAPTIONS), batched)


def _comfy_quantized(ref: dict, kind: str) -> tuple[dict, dict]:
    """The tiny encoder's state as a ComfyUI int8 / int8 ConvRot / fp8 file holds it (every
    layer linear's codes, ``weight_scale`` and ``comfy_quant``), and each linear's codes."""
    sd, codes = {}, {}
    for k, v in ref.items():
        if v.ndim == 2 and k.startswith("layers."):  # every linear weight, like ComfyUI's files
            q, s, fmt = quantize_fp8(v) if kind == "fp8" else quantize_int8(v, 16 if "convrot" in kind else 0)
            stem = "model." + k.removesuffix(".weight")
            sd |= {f"{stem}.weight": q, f"{stem}.weight_scale": s, f"{stem}.comfy_quant": encode_format(fmt)}
            codes[k.removesuffix(".weight")] = q
        else:
            sd["model." + k] = v
    return sd, codes


@pytest.mark.parametrize("kind,tol", [("int8", 0.01), ("int8_convrot", 0.01), ("fp8", 0.05)])
def test_quantized_comfy_file_dequantizes_on_load(tmp_path, batched, kind, tol):
    ref = tiny_state_dict(tiny_config())
    sd, _ = _comfy_quantized(ref, kind)
    file = tmp_path / "q.safetensors"
    save_file(sd, str(file))
    (tmp_path / "tokenizer").mkdir()
    tiny_tokenizer().save_pretrained(tmp_path / "tokenizer")
    loaded = TextEncoder.load(str(file), dtype="fp32")  # tokenizer from the sibling tokenizer/
    assert loaded.key_id == "qwen3.5-9b/fp32/compute"  # dequantized: precision stays compute
    for k, w in loaded.model.named_parameters():
        err = ((w - ref[k]).norm() / ref[k].norm()).item()
        assert (0 < err < tol) if "model." + k + "_scale" in sd else err == 0, k
    # the random tiny model amplifies weight error (its Gated DeltaNet gated norms see small
    # outputs), so outputs only move by a bounded amount; the weights above are the real check
    rel = max(((o - s).norm() / s.norm()).item() for o, s in zip(loaded.encode(CAPTIONS), batched))
    assert 0 < rel < 0.5


def test_missing_tokenizer_names_files_and_source(tmp_path):
    file = tmp_path / "te.safetensors"
    save_file(tiny_state_dict(tiny_config()), str(file))
    with pytest.raises(TextEncoderError) as err:
        TextEncoder.load(str(file))
    msg = str(err.value)
    assert "tokenizer.json" in msg and "tokenizer_config.json" in msg and "chat template" in msg
    assert "OpenMOSS-Team/MOSS-Image-Base" in msg and "tokenizer/" in msg
    with pytest.raises(TextEncoderError, match="does not exist"):
        TextEncoder.load(str(tmp_path / "nope"))


def test_key_id_and_identity():
    assert TextEncoder.load("tiny").key_id == "qwen3.5-tiny/bf16/compute"  # auto on CPU -> bf16
    assert TextEncoder.load("tiny", dtype="fp16").key_id == "qwen3.5-tiny/fp16/compute"
    assert TextEncoder.identity("tiny", "fp32") == "qwen3.5-tiny/fp32/compute"
    assert TextEncoder.identity("/models/moss", "auto", "cpu") == "qwen3.5-9b/bf16/compute"
    with pytest.raises(ValueError, match="fp64"):
        TextEncoder.load("tiny", dtype="fp64")
    assert resolve_dtype("auto", "cpu", cpu_auto="fp32") == torch.float32
    assert dtype_name(torch.bfloat16) == "bf16"


def test_token_counter_counts_what_is_encoded(enc):
    counter = TokenCounter("tiny")
    assert counter.count_many(CAPTIONS) == [len(i) for i in enc.token_ids(CAPTIONS)]


def test_cpu_forward_uses_pytorch_linear_attention_ops():
    before = {n: getattr(qwen, n) for n in ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")}
    with torch_linear_attention_ops(torch.device("cpu")):
        for name, fn in before.items():  # the torch reference, not fla / causal-conv1d / a hub kernel
            ref = getattr(qwen, name)
            assert inspect.isfunction(ref) and not hasattr(ref, "__wrapped__")
            assert ref.__name__ == name and ref.__module__ == qwen.__name__
    assert {n: getattr(qwen, n) for n in before} == before


def test_streamed_layers_encode_exactly_as_resident_ones(batched):
    """The text encoder's layers streamed from host memory through two slots (on the CPU
    here: the same ring as on CUDA, copies without a side stream) give the same states."""
    from kohakumoss.memory.streaming import stream_weights

    streamed = TextEncoder.load("tiny", dtype="fp32")
    streamed.ring = ring = stream_weights(streamed.model, "cpu", 2, blocks=list(streamed.model.layers))
    assert_same(streamed.encode(CAPTIONS), batched)
    assert ring.loads >= len(streamed.model.layers) and ring.n_slots == 2


def test_text_stream_choice(monkeypatch):
    """``on`` streams on CUDA, ``auto`` when the weights exceed STREAM_SHARE of free memory,
    ``off`` never; off CUDA never."""
    from kohakumoss.encoders import text as T

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * gib, 80 * gib))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert T._streams("on", cuda, gib) and not T._streams("off", cuda, 100 * gib)
    assert T._streams("auto", cuda, 17 * gib) and not T._streams("auto", cuda, 15 * gib)
    assert not T._streams("on", cpu, 100 * gib)
    with pytest.raises(ValueError, match="one of auto, on, off"):
        T._streams("yes", cuda, gib)


# -- int8 / fp8 text encoders (encoders.text_precision) ----------------------------------------
QUANT_CAPTIONS = ["a red circle on white", "kohaku, amber, a fox in the snow at dusk", ""]


def _dequantized_twin(q):
    """The same tiny encoder in fp32 whose layer linears hold ``q``'s dequantized weights."""
    from kohakumoss.encoders.text import TextEncoder

    twin = TextEncoder.load("tiny", dtype="fp32")
    quantized = dict(q.model.named_modules())
    for name, m in twin.model.named_modules():
        if hasattr(quantized.get(name), "codes"):
            m.weight.data.copy_(quantized[name].weight)
    return twin


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_a_weight_only_text_encoder_is_its_dequantized_model(precision):
    from kohakumoss.encoders.text import TextEncoder
    from kohakumoss.quant.linear import QuantizedLinear

    q = TextEncoder.load("tiny", dtype="fp32", precision=precision)
    linears = [m for m in q.model.layers.modules() if isinstance(m, QuantizedLinear)]
    assert linears and not any(type(m) is torch.nn.Linear for m in q.model.layers.modules())
    assert {m.codes.dtype for m in linears} == {torch.int8 if precision == "int8" else torch.float8_e4m3fn}
    twin = _dequantized_twin(q)
    for a, b in zip(q.encode(QUANT_CAPTIONS), twin.encode(QUANT_CAPTIONS)):
        assert torch.equal(a, b)
    # and the weights are within the format's round trip of the fp32 ones
    plain = dict(TextEncoder.load("tiny", dtype="fp32").model.named_modules())
    step = {"int8": 1 / 127, "fp8": 2.0 ** -4}[precision]  # half a code step of the row's amax
    for name, m in q.model.named_modules():
        if isinstance(m, QuantizedLinear):
            w = plain[name].weight
            amax = w.abs().amax(dim=1, keepdim=True)
            assert ((m.weight - w).abs() <= step * amax + 1e-7).all(), name


def test_fp8_compute_is_the_fp8_product_of_the_rounded_activations():
    from kohakumoss.encoders.text import TextEncoder
    from kohakumoss.quant.linear import QuantizedLinear
    from kohakumoss.quant.ops import dequantize_rows, fp8_rows

    q = TextEncoder.load("tiny", dtype="fp32", precision="fp8-compute")
    lin = next(m for m in q.model.layers.modules() if isinstance(m, QuantizedLinear))
    assert lin.fp8_compute
    x = torch.randn(7, lin.in_features, generator=torch.Generator().manual_seed(0))
    xq, xs = fp8_rows(x)
    want = torch.nn.functional.linear(xq.float() * xs[:, None], dequantize_rows(lin.codes, lin.scale, torch.float32))
    assert torch.allclose(lin(x), want, rtol=1e-5, atol=1e-6)
    assert len(q.encode(QUANT_CAPTIONS)) == 3


def test_each_text_precision_keys_its_own_cache_entries():
    from kohakumoss.cache.keys import text_key
    from kohakumoss.encoders.text import TextEncoder

    ids = {pr: TextEncoder.identity("tiny", "fp32", "cpu", pr) for pr in ("keep", "int8", "fp8", "fp8-compute")}
    assert len(set(ids.values())) == 4 and ids["keep"].endswith("/compute")  # keep: the keys as before
    assert all(TextEncoder.load("tiny", dtype="fp32", precision=pr).key_id == ids[pr] for pr in ids)
    keys = {text_key(i, "fp32", "a red circle") for i in ids.values()}
    assert len(keys) == 4


def test_the_params_text_precision_reaches_the_cache_identity():
    from kohakumoss.cache.build import text_identity
    from conftest import make_params

    ds = [{"source": "kohya", "path": "my_set"}]
    keep = make_params(ds, encoders={"text_dtype": "fp32", "device": "cpu"})
    fp8 = make_params(ds, encoders={"text_dtype": "fp32", "device": "cpu", "text_precision": "fp8"})
    assert text_identity(keep).endswith("/compute") and text_identity(fp8).endswith("/fp8")



@pytest.mark.parametrize("kind", ["int8", "int8_convrot", "fp8"])
def test_a_comfy_quantized_file_is_used_as_stored(tmp_path, kind):
    """A ComfyUI int8 / fp8 text-encoder file under the matching text_precision: its codes,
    scales and rotation held as the file has them, the outputs those of the file dequantized."""
    from kohakumoss.quant.linear import QuantizedLinear

    sd, codes = _comfy_quantized(tiny_state_dict(tiny_config()), kind)
    file = tmp_path / "q.safetensors"
    save_file(sd, str(file))
    (tmp_path / "tokenizer").mkdir()
    tiny_tokenizer().save_pretrained(tmp_path / "tokenizer")
    precision = "fp8" if kind == "fp8" else "int8"
    held = TextEncoder.load(str(file), dtype="fp32", precision=precision)
    dense = TextEncoder.load(str(file), dtype="fp32")  # the file dequantized
    linears = {n: m for n, m in held.model.named_modules() if isinstance(m, QuantizedLinear)}
    assert linears.keys() == codes.keys()
    assert all(torch.equal(m.codes, codes[n]) for n, m in linears.items())
    assert all(m.group == (16 if "convrot" in kind else 0) for m in linears.values())
    for a, b in zip(held.encode(QUANT_CAPTIONS), dense.encode(QUANT_CAPTIONS)):
        if "convrot" in kind:  # x H then the codes, against (codes H) x: fp32 rounding apart,
            assert ((a - b).norm() / b.norm()).item() < 1e-3  # which the random model amplifies
        else:
            assert torch.equal(a, b)
