"""params.yaml loading: strict sections, clear errors, the shipped file loads."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import yaml

from kohakumoss.config import stage_params
from kohakumoss.params import load_params, parse_params
from kohakumoss.configlib import ConfigError, coerce

from conftest import BASE, ROOT, make_params


def test_shipped_params_load():
    p = load_params(ROOT / "params.yaml")
    assert p.data.datasets[0].source == "kohya"
    assert p.resolution.size_step % 16 == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.batching.max_tokens = 3  # type: ignore[misc]


@pytest.mark.parametrize("section, body, needle", [
    ("batching", {"max_tokenz": 10}, "batching.max_tokenz: unknown key; did you mean 'max_tokens'"),
    ("batching", {"max_tokens": 1}, "batching.max_tokens = 1 is not allowed: an integer >= 2"),
    ("batching", {"max_tokens": "lots"}, "batching.max_tokens = 'lots' is not allowed: an integer"),
    ("batching", {"mode": "greedy"}, "one of 'tokens', 'tokens_ffd', 'count'"),
    ("resolution", {"size_step": 24}, "resolution.size_step = 24 is not allowed: a positive multiple of 16"),
    ("resolution", {"aspect_range": [2.0, 3.0]}, "0 < min <= 1 <= max"),
    ("resolution", {"background": [300, 0, 0]}, "resolution.background"),
    ("resolution", {"flip": "yes"}, "resolution.flip = 'yes' is not allowed: true or false"),
    ("caption", {"text_drop": 1.5}, "caption.text_drop = 1.5 is not allowed: a probability in [0, 1]"),
    ("caption", {"template": {"template": "tagz"}}, "caption.template"),
    ("data", {"rescan": "sometimes"}, "data.rescan = 'sometimes'"),
])
def test_bad_values_name_key_value_and_allowed(section, body, needle):
    raw = {k: dict(v) for k, v in BASE.items()}
    raw["data"] = {**BASE["data"], "datasets": [{"source": "kohya", "path": "x"}]}
    raw[section] = {**raw.get(section, {}), **body}
    with pytest.raises(ConfigError) as e:
        parse_params(raw, "p.yaml")
    assert needle in str(e.value)
    assert "p.yaml" in str(e.value)


def test_unknown_section_and_dataset_errors():
    with pytest.raises(ConfigError, match="unknown section 'batchin'; did you mean 'batching'"):
        parse_params({"batchin": {}, "data": {"datasets": [{"source": "kohya", "path": "x"}]}})
    with pytest.raises(ConfigError, match="datasets must be a non-empty list"):
        parse_params({"data": {"datasets": []}})
    with pytest.raises(ConfigError, match=r"datasets\[0\].source = 'kohyaa' is not allowed: one of"):
        parse_params({"data": {"datasets": [{"source": "kohyaa", "path": "x"}]}})
    with pytest.raises(ConfigError, match=r"datasets\[0\].repeat_prefx: unknown key"):
        parse_params({"data": {"datasets": [{"source": "kohya", "path": "x", "repeat_prefx": "first"}]}})
    with pytest.raises(ConfigError, match=r"datasets\[0\].path is required"):
        parse_params({"data": {"datasets": [{"source": "kohya"}]}})


def test_exact_budget_needs_tokenizer():
    with pytest.raises(ConfigError, match="needs caption.tokenizer"):
        make_params([{"source": "kohya", "path": "x"}], batching={"token_budget": "exact"})


def test_load_params_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_params(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_params(bad)


def test_dataset_level_keys_and_caption_override():
    p = make_params([{"source": "kohya", "path": "x", "weight": 2, "loss_weight": 0.5,
                      "caption": {"template": "nl"}}])
    d = p.data.datasets[0]
    assert (d.weight, d.loss_weight) == (2.0, 0.5)
    assert type(d.caption).__name__.lower().startswith("nl")


def test_kernels_section_defaults_and_refusals():
    k = make_params([{"source": "kohya", "path": "x"}]).kernels
    assert (k.table, k.tune_seconds, k.retune_seconds, k.backends) == ("auto", 60.0, 0.0, ())
    k = make_params([{"source": "kohya", "path": "x"}],
                    kernels={"table": "off", "backends": ["compile"], "tune_seconds": 5}).kernels
    assert (k.table, k.backends, k.tune_seconds) == ("off", ("compile",), 5.0)
    with pytest.raises(ConfigError, match="kernels.table = 'fast' is not allowed"):
        make_params([{"source": "kohya", "path": "x"}], kernels={"table": "fast"})
    with pytest.raises(ConfigError, match=r"kernels.tune_seconds = -1.0 is not allowed: a number >= 0"):
        make_params([{"source": "kohya", "path": "x"}], kernels={"tune_seconds": -1})
    with pytest.raises(ConfigError, match="kernels.tune_second: unknown key; did you mean 'tune_seconds'"):
        make_params([{"source": "kohya", "path": "x"}], kernels={"tune_second": 1})


def test_stage_params_selects_declared_keys():
    p = make_params([{"source": "kohya", "path": "x"}])
    sp = stage_params(p, ["run.seed", "batching"])
    assert sp["run.seed"] == 0 and sp["batching"]["max_tokens"] == 96
    yaml.safe_dump(sp)  # plain data only


@pytest.mark.parametrize("text, value", [("1e-4", 1e-4), ("5E-5", 5e-5), ("+1e-3", 1e-3),
                                         (".5e-3", 5e-4), ("1.0e4", 1e4), ("-2e-1", -0.2)])
def test_scientific_strings_are_numbers(text, value):
    """YAML 1.1 reads ``1e-4`` (no dot) as a string; a float field takes it as the number."""
    assert coerce(float, text, "optim.lr") == value
    assert coerce(float | None, text, "optim.lr") == value


def test_scientific_strings_for_integers_only_when_integral():
    assert coerce(int, "1e3", "train.steps") == 1000 and coerce(int, "2.5E+2", "train.steps") == 250
    for bad in ("1e-3", "1.5e0", "1e30"):
        with pytest.raises(ConfigError, match=r"train.steps = .* is not allowed: an integer"):
            coerce(int, bad, "train.steps")


@pytest.mark.parametrize("text", ["abc", "1e", "e5", "0x10", "nan", "inf", "1e999", "1_0e3", "1e-4x"])
def test_non_numeric_strings_still_refused(text):
    with pytest.raises(ConfigError, match=r"optim.lr = .* is not allowed: a number"):
        coerce(float, text, "optim.lr")


def test_params_file_with_lr_in_scientific_notation(tmp_path):
    """What `dvc exp run -S optim.lr=1e-4` writes into params.yaml loads as 0.0001."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    text = yaml.safe_dump(raw).replace(f"lr: {raw['optim']['lr']}", "lr: 1e-4")
    assert "lr: 1e-4" in text
    path = tmp_path / "params.yaml"
    path.write_text(text)
    assert yaml.safe_load(text)["optim"]["lr"] == "1e-4"  # what YAML 1.1 makes of it
    assert load_params(path).optim.lr == 1e-4
    path.write_text(text.replace("lr: 1e-4", "lr: fast"))
    with pytest.raises(ConfigError, match="optim.lr = 'fast' is not allowed: a number"):
        load_params(path)


def test_loading_params_of_the_tiny_model_imports_no_torch(tmp_path):
    """``kmoss scan`` and ``kmoss plan`` load params first (every check, the adapter's targets
    included) and need no torch after: a stage that runs on every ``dvc repro`` starts in about
    a second, not six."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["model"].update(transformer="tiny", text_encoder="tiny", vae="tiny")
    raw["caption"]["tokenizer"] = "tiny"
    raw["data"]["datasets"][0]["path"] = str(ROOT / "examples" / "dataset")
    raw["adapter"]["targets"] = [r"layers\.0\.proj\.q$"]
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    code = ("import sys; from kohakumoss.params import load_params; load_params(sys.argv[1]); "
            "print(sorted(m for m in ('torch', 'lycoris', 'transformers') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr
    raw["adapter"]["targets"] = [r"layers\.\d+\.attn\.q$"]  # and a dead target is still refused
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    res = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    assert res.returncode != 0 and "layers.N.proj.q" in res.stderr, res.stderr


def test_the_trainer_and_the_cache_readers_import_no_transformers():
    """A training run on cached text needs no text encoder: ``kmoss train``'s modules (and the
    cache readers every stage shares) leave transformers unimported (~2 s a start); the
    encoders load where they encode."""
    code = ("import sys; import kohakumoss.training.trainer, kohakumoss.cache.fill, "
            "kohakumoss.cache.weights; from kohakumoss.encoders import VAE, to_tokens; "
            "print('transformers' in sys.modules); from kohakumoss.encoders import TextEncoder; "
            "print('transformers' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.split() == ["False", "True"], res.stdout + res.stderr
