"""The plan: determinism, invalidation, budgets, and what it records per slot."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from kohakumoss.data.plan import PlanError
from kohakumoss.data.planfile import make_plan
from kohakumoss.data.scan import scan

from conftest import make_params


@pytest.fixture
def catalog(tmp_path, kohya_dataset):
    p = make_params([{"source": "kohya", "path": str(kohya_dataset)}])
    scan(p, tmp_path / "catalog")
    return tmp_path / "catalog", kohya_dataset


def _plan(tmp_path, catalog, name="plan", datasets=None, **overrides):
    cat, ds = catalog
    p = make_params(datasets or [{"source": "kohya", "path": str(ds)}], **overrides)
    m, summary = make_plan(p, cat, tmp_path / name)
    return m, pq.read_table(tmp_path / name / "plan.parquet"), summary


def test_plan_is_byte_identical_and_keyed(tmp_path, catalog):
    m1, t1, _ = _plan(tmp_path, catalog, "a")
    m2, t2, _ = _plan(tmp_path, catalog, "b")
    assert (tmp_path / "a" / "plan.parquet").read_bytes() == (tmp_path / "b" / "plan.parquet").read_bytes()
    assert (m1.key, m1.content_hash) == (m2.key, m2.content_hash)
    # knobs the plan does not read leave it alone
    m3, _, _ = _plan(tmp_path, catalog, "c", data={"num_workers": 3, "scan_workers": 1, "prefetch": 4},
                     train={"checkpoint_every": 7, "dtype": "fp32"}, optim={"lr": 0.5},
                     adapter={"algo": "lokr"}, objective={"timesteps": "uniform"})
    assert (m3.key, m3.content_hash) == (m1.key, m1.content_hash)  # train-only knobs
    # the seed and every planning knob change it
    for name, over in {"seed": {"run": {"seed": 1}},
                       "flip": {"resolution": {"flip": True}},
                       "budget": {"batching": {"max_tokens": 128}},
                       "variants": {"caption": {"variants": 2}},
                       "steps": {"train": {"steps": 41}}}.items():
        m, _, _ = _plan(tmp_path, catalog, name, **over)
        assert m.key != m1.key and m.content_hash != m1.content_hash, name


def test_plan_covers_the_whole_run(tmp_path, catalog):
    _, t, s = _plan(tmp_path, catalog, train={"steps": 7, "grad_accum": 3}, parallel={"world_size": 2})
    cols = t.to_pydict()
    assert s["batches"] == 7 * 3 * 2 == max(cols["batch"]) + 1
    g = np.array(cols["batch"])
    assert np.array_equal(np.array(cols["index"]), g // 2) and np.array_equal(np.array(cols["rank"]), g % 2)
    assert np.array_equal(np.array(cols["step"]), (g // 2) // 3)
    assert np.array_equal(np.array(cols["micro"]), (g // 2) % 3)
    assert all(b <= a for a, b in zip(cols["batch"][1:], cols["batch"][:-1]))


@pytest.mark.parametrize("mode", ["tokens", "tokens_ffd", "count"])
@pytest.mark.parametrize("res", ["bucket", "resize", "crop", "keep", "square"])
def test_budget_never_exceeded_and_sizes_valid(tmp_path, catalog, mode, res):
    _, t, s = _plan(tmp_path, catalog, batching={"mode": mode, "max_tokens": 96, "batch_size": 2},
                    resolution={"mode": res})
    cols = t.to_pydict()
    joint = np.bincount(cols["batch"], weights=np.add(cols["image_tokens"], cols["text_tokens"]))
    assert joint.max() <= 96
    assert all(h % 16 == 0 and w % 16 == 0 for h, w in zip(cols["target_h"], cols["target_w"]))
    for l, tp, r, b, sw, sh in zip(cols["crop_l"], cols["crop_t"], cols["crop_r"], cols["crop_b"],
                                    cols["src_w"], cols["src_h"]):
        assert 0 <= l < r <= sw and 0 <= tp < b <= sh
    if mode == "count":
        assert set(np.bincount(cols["batch"])) == {2}


def test_overlong_policies(tmp_path, catalog):
    # 64x64 images at area 4096 -> 16 image tokens; captions estimate ~22 text tokens
    over = {"max_tokens": 20}
    _, t, s = _plan(tmp_path, catalog, "trunc", batching={**over, "overlong": "truncate_text"})
    cols = t.to_pydict()
    assert all(i + x <= 20 for i, x in zip(cols["image_tokens"], cols["text_tokens"]))
    assert any(lim > 0 for lim in cols["text_limit"])
    _, t, _ = _plan(tmp_path, catalog, "tok", batching={"max_tokens": 30, "overlong": "drop_tokens"})
    cols = t.to_pydict()
    assert any(k > 0 for k in cols["img_keep"]) and all(i >= 1 for i in cols["image_tokens"])
    with pytest.raises(PlanError, match="yields no batch"):
        _plan(tmp_path, catalog, "drop", batching={**over, "overlong": "drop"})


def test_weights_and_repeats(tmp_path, catalog):
    # folders 3_alpha (4 images x 3) and 1_beta (3 images): 15 occurrences per epoch
    _, t, s = _plan(tmp_path, catalog, train={"steps": 10})
    assert s["epoch_items"][0] == 15
    _, t, s = _plan(tmp_path, catalog, "w", datasets=[{"source": "kohya", "path": str(catalog[1]),
                                                        "weight": 2.0}], train={"steps": 10})
    assert s["epoch_items"][0] == 30


def test_captions_and_text_drop_recorded(tmp_path, catalog):
    _, t, s = _plan(tmp_path, catalog, caption={"text_drop": 0.5}, train={"steps": 40})
    cols = t.to_pydict()
    assert all(c for c in cols["caption"])  # the undropped rendering is always stored
    share = np.mean(cols["text_drop"])
    assert 0.3 < share < 0.7
    assert s["text_dropped"] == sum(cols["text_drop"])
    # a caption variant is a fixed string per (row, variant)
    seen: dict = {}
    for uid, v, c in zip(cols["uid"], cols["variant"], cols["caption"]):
        assert seen.setdefault((uid, v), c) == c
    summary = json.loads((tmp_path / "plan" / "summary.json").read_text())
    assert summary["batches"] == 40


def test_stale_catalog_is_refused(tmp_path, catalog):
    from kohakumoss.artifacts import ArtifactError

    with pytest.raises(ArtifactError, match="run `kmoss scan` again"):
        _plan(tmp_path, catalog, datasets=[{"source": "folder", "path": str(catalog[1])}])
    with pytest.raises(ArtifactError, match="kmoss scan"):
        make_plan(make_params([{"source": "kohya", "path": "x"}]), tmp_path / "none", tmp_path / "o")


def test_longer_run_only_appends_batches(tmp_path, catalog):
    _, short, _ = _plan(tmp_path, catalog, "short", train={"steps": 10})
    _, long, _ = _plan(tmp_path, catalog, "long", train={"steps": 25})
    n = short.num_rows
    assert long.slice(0, n).equals(short)


def _tiny_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "user", "assistant", "<think>", ",", "shared", "colour", "extra", "tag"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<think>"]})
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
                          "<|im_start|>assistant\n<think>\n{% endif %}")
    fast.save_pretrained(folder)
    return fast


def test_exact_token_counts_from_a_tokenizer(tmp_path, catalog):
    pytest.importorskip("transformers")
    fast = _tiny_tokenizer(tmp_path / "tok")
    m, t, s = _plan(tmp_path, catalog, caption={"tokenizer": str(tmp_path / "tok")},
                    batching={"max_tokens": 200})
    assert s["token_budget"] == "exact"
    cols = t.to_pydict()
    for caption, n in zip(cols["caption"], cols["text_tokens"]):
        text = fast.apply_chat_template([{"role": "user", "content": caption}], tokenize=False,
                                        add_generation_prompt=True)
        assert n == len(fast(text, add_special_tokens=False)["input_ids"])
    # the empty caption still carries the template's tokens
    from kohakumoss.data.tokens import TokenCounter

    assert TokenCounter(str(tmp_path / "tok")).count_many([""]) == [6]
    m_est, _, _ = _plan(tmp_path, catalog, "est", batching={"max_tokens": 200})
    assert m.key != m_est.key


def test_a_tokenizer_without_chat_template_is_refused_by_planner_and_encoder(tmp_path):
    """The planner and the text encoder open tokenizers through one helper: same refusal."""
    from kohakumoss.configlib import ConfigError
    from kohakumoss.data.tokens import TokenCounter
    from kohakumoss.encoders.text import TextEncoderError, load_tokenizer

    fast = _tiny_tokenizer(tmp_path / "tok")
    fast.chat_template = None
    fast.save_pretrained(tmp_path / "bare")
    (tmp_path / "bare" / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ConfigError, match="no chat template.*caption.tokenizer"):
        TokenCounter(str(tmp_path / "bare"))
    with pytest.raises(TextEncoderError, match="no chat template.*tokenizer/ folder"):
        load_tokenizer(tmp_path, str(tmp_path / "bare"))


def test_failed_plan_loses_nothing(tmp_path, catalog):
    _plan(tmp_path, catalog, "p")
    snapshot = {f.name: f.read_bytes() for f in (tmp_path / "p").iterdir()}
    with pytest.raises(PlanError, match="overlong to 'drop_tokens'"):
        _plan(tmp_path, catalog, "p", batching={"max_tokens": 8, "overlong": "drop"})
    assert {f.name: f.read_bytes() for f in (tmp_path / "p").iterdir()} == snapshot
