"""Caption templates, estimates and text dropout (``docs/data.md#captions``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kohakumoss.configlib import ConfigError, to_plain
from kohakumoss.data.captions import (
    TEMPLATES, JsonTemplate, MixTemplate, NlTemplate, TagsTemplate, char_columns,
    estimate_caption_chars, estimate_text_tokens, normalize_tag, parse_template, render_caption,
    split_tags, text_dropped, unescape_tag,
)
from kohakumoss.data.rows import Row
from kohakumoss.seeding import rng_of

WHERE = "caption.template"


def tags_of(n: int) -> list[str]:
    return [f"tag{i}" for i in range(n)]


def tpl(**options) -> TagsTemplate:
    return parse_template({"template": "tags", **options}, WHERE)


def variants(template, row: Row, n: int, seed: int = 0) -> list[str]:
    return [render_caption(template, row, seed, 7, v) for v in range(n)]


# ---- tag utilities ---------------------------------------------------------------------

def test_split_tags():
    assert split_tags(" a, b_c ,, ,d ") == ["a", "b_c", "d"]
    assert split_tags("") == []


def test_unescape_and_normalize():
    assert unescape_tag(r"foo \(bar\) \[x\] \{y\} \\ \n") == r"foo (bar) [x] {y} \\ \n"
    assert normalize_tag(r"long_hair \(cosplay\)") == "long hair (cosplay)"
    assert normalize_tag(r"a_b \(c\)", underscores=False) == "a_b (c)"
    assert normalize_tag(r"a_b \(c\)", unescape=False) == r"a b \(c\)"


def test_tags_render_normalises_head_and_body():
    row = Row("x", tags=[r"long_hair", r"smile \(happy\)"], artist="some_artist")
    out = render_caption(tpl(shuffle=False), row, 0, 0, 0)
    assert out == "some artist, long hair, smile (happy)"
    out = render_caption(tpl(shuffle=False, underscores=False, unescape=False, joiner=" | ",
                             prefix="<", suffix=">", keep=[]), row, 0, 0, 0)
    assert out == r"<long_hair | smile \(happy\)>"


# ---- tags template ----------------------------------------------------------------------

def test_keep_first_and_keep_sep_fix_the_head():
    row = Row("x", tags=["a", "b", "c", "|||", *tags_of(20)], artist="art")
    t = tpl(keep_first=1)
    for cap in variants(t, row, 8):
        parts = cap.split(", ")
        assert parts[:4] == ["art", "a", "b", "c"]
        assert "|||" not in parts and sorted(parts[4:]) == sorted(tags_of(20))
    # keep_first alone, no separator
    row = Row("x", tags=["a", "b", *tags_of(20)])
    for cap in variants(tpl(keep_first=2, keep=[]), row, 8):
        assert cap.split(", ")[:2] == ["a", "b"]


def test_shuffle_only_permutes_non_fixed_tags():
    row = Row("x", tags=["f1", "f2", "|||", *tags_of(12)], artist="art", rating="safe")
    t = tpl(keep=["artist", "rating"])
    caps = variants(t, row, 16)
    assert len(set(caps)) > 1
    for cap in caps:
        parts = cap.split(", ")
        assert parts[:4] == ["art", "safe", "f1", "f2"]
        assert sorted(parts[4:]) == sorted(tags_of(12))
    # no shuffle: the original order every time
    unshuffled = ", ".join(["art", "f1", "f2", *tags_of(12)])
    assert set(variants(tpl(shuffle=False), row, 4)) == {unshuffled}


def test_group_sep_keeps_groups_contiguous():
    groups = [["a1", "a2", "a3"], ["b1", "b2"], ["c1", "c2", "c3", "c4"]]
    row = Row("x", tags=[*groups[0], "%%", *groups[1], "%%", *groups[2]])
    orders = set()
    for cap in variants(tpl(), row, 40):
        parts = cap.split(", ")
        assert "%%" not in parts
        seen = []
        i = 0
        while i < len(parts):
            g = next(g for g in groups if parts[i] in g)
            assert sorted(parts[i:i + len(g)]) == sorted(g)
            seen.append(groups.index(g))
            i += len(g)
        assert sorted(seen) == [0, 1, 2]
        orders.add(tuple(seen))
    assert len(orders) > 1  # group order is shuffled too


def test_draw_order_matches_spec():
    """Group draws, then per kept group: tag draws and a permutation, then the groups' order."""
    t = tpl(keep=[], tag_dropout=0.3, group_dropout=0.4)
    groups = [tags_of(5), ["x1", "x2", "x3"], ["y1", "y2", "y3", "y4"]]
    row = Row("x", tags=[*groups[0], "%%", *groups[1], "%%", *groups[2]])
    for variant in range(20):
        rng = rng_of("caption", 3, 11, variant)
        kept = [g for g in groups if rng.random() >= 0.4]
        out = []
        for g in kept:
            g = [x for x in g if rng.random() >= 0.3]
            if len(g) >= 2:
                g = list(np.asarray(g)[rng.permutation(len(g))])
            out.append(g)
        if len(out) >= 2:
            out = [out[i] for i in rng.permutation(len(out))]
        expected = ", ".join(x for g in out for x in g)
        assert render_caption(t, row, 3, 11, variant) == expected


def test_tag_dropout_rate():
    row = Row("x", tags=tags_of(100))
    t = tpl(keep=[], tag_dropout=0.25, shuffle=False)
    kept = [len(split_tags(c)) for c in variants(t, row, 200, seed=5)]
    assert abs(np.mean(kept) / 100 - 0.75) < 0.02
    assert set(variants(tpl(keep=[], tag_dropout=1.0), row, 5)) == {""}
    no_dropout = tpl(keep=[], tag_dropout=0.0, shuffle=False)
    assert set(variants(no_dropout, row, 5)) == {", ".join(tags_of(100))}


def test_group_dropout_rate():
    row = Row("x", tags=["a", "%%", "b", "%%", "c", "%%", "d"])
    t = tpl(keep=[], group_dropout=0.4)
    kept = [len(split_tags(c)) for c in variants(t, row, 2000, seed=9)]
    assert abs(np.mean(kept) / 4 - 0.6) < 0.03


def test_render_caption_is_a_fixed_string_per_seed_row_variant():
    row = Row("x", tags=tags_of(30), artist="art")
    t = tpl(tag_dropout=0.1)
    a = variants(t, row, 4)
    assert a == variants(t, row, 4)
    assert len(set(a)) == 4
    assert a != variants(t, row, 4, seed=1)
    assert render_caption(t, row, np.int64(0), np.int64(7), np.int64(2)) == a[2]
    assert render_caption(t, row, 0, 8, 2) != a[2]


def test_empty_rows_render():
    row = Row("x")
    for name in TEMPLATES:
        assert render_caption(parse_template({"template": name}, WHERE), row, 0, 0, 0) in ("", "{}")
    assert render_caption(tpl(prefix="a photo", suffix="."), row, 0, 0, 0) == "a photo."


# ---- nl / mix / json ----------------------------------------------------------------------

def test_nl_keep_and_fallback():
    t = parse_template({"template": "nl", "keep": ["artist", "tags"],
                        "fallback": {"shuffle": False, "keep": []}}, WHERE)
    row = Row("x", tags=["a_b", "c"], artist="art", caption_nl="A cat.")
    assert render_caption(t, row, 0, 0, 0) == "art, a_b, c. A cat."
    assert render_caption(parse_template({"template": "nl"}, WHERE), row, 0, 0, 0) == "A cat."
    no_nl = Row("x", tags=["a_b", "c"], artist="art", caption_nl="")
    assert render_caption(t, no_nl, 0, 0, 0) == "a b, c"
    assert isinstance(t.fallback, TagsTemplate)


def test_mix_chooses_both_branches():
    t = parse_template({"template": "mix", "p_nl": 0.3, "tags": {"shuffle": False}}, WHERE)
    assert isinstance(t.nl, NlTemplate) and isinstance(t.tags, TagsTemplate)
    row = Row("x", tags=["a", "b"], caption_nl="A cat.")
    caps = variants(t, row, 400)
    share = caps.count("A cat.") / len(caps)
    assert set(caps) == {"A cat.", "a, b"} and abs(share - 0.3) < 0.07
    assert set(variants(t, Row("x", tags=["a", "b"]), 20)) == {"a, b"}
    always = parse_template({"template": "mix", "p_nl": 1.0}, WHERE)
    never = parse_template({"template": "mix", "p_nl": 0.0, "tags": {"shuffle": False}}, WHERE)
    assert set(variants(always, row, 10)) == {"A cat."}
    assert set(variants(never, row, 10)) == {"a, b"}


JSON_ROW = Row("x", tags=["a", "b"], artist="art", rating="safe", caption_nl="Ünïcode text",
               json={"zeta": 1, "meta": {"y": 2, "x": [1, "é"]}, "source": ["s1", "s2"]})


def test_json_lines_style_and_order():
    t = parse_template({"template": "json", "order": ["tags", "missing", "artist"]}, WHERE)
    assert render_caption(t, JSON_ROW, 0, 0, 0).split("\n") == [
        "tags: a, b", "artist: art", "caption_nl: Ünïcode text",
        'meta: {"x":[1,"é"],"y":2}', "rating: safe", "source: s1, s2", "zeta: 1"]


def test_json_json_style_and_fields():
    t = parse_template({"template": "json", "style": "json", "fields": ["rating", "tags"],
                        "order": ["zeta"]}, WHERE)
    out = render_caption(t, JSON_ROW, 0, 0, 0)
    assert list(json.loads(out)) == ["zeta", "meta", "rating", "source", "tags"]
    assert json.loads(out)["tags"] == ["a", "b"] and "Ü" not in out and "é" in out
    # a row json key is not overridden by a row field
    row = Row("x", artist="field", json={"artist": "meta"})
    default_fields = parse_template({"template": "json", "style": "json"}, WHERE)
    assert render_caption(default_fields, row, 0, 0, 0) == '{"artist":"meta"}'


def test_json_field_dropout_respects_keep():
    t = parse_template({"template": "json", "field_dropout": 0.5, "keep": ["artist"]}, WHERE)
    counts = {k: 0 for k in ("artist", "caption_nl", "meta", "rating", "source", "tags", "zeta")}
    for cap in variants(t, JSON_ROW, 400):
        for line in cap.split("\n"):
            counts[line.split(":")[0]] += 1
    assert counts.pop("artist") == 400
    assert all(130 < c < 270 for c in counts.values()), counts
    full = parse_template({"template": "json", "field_dropout": 1.0, "keep": ["artist"]}, WHERE)
    assert set(variants(full, JSON_ROW, 5)) == {"artist: art"}


# ---- estimates -------------------------------------------------------------------------

ALPHABET = list("abcxyz_ é()\\[]{}\"'") + ["\\(", "\\)", "%%", "|||"]
PLAIN = list("abcxyz_ é()[]{}'")


def random_row(rng: np.random.Generator, alphabet: list[str]) -> Row:
    def text(lo: int, hi: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.integers(lo, hi)))

    tags = [text(0, 8) for _ in range(rng.integers(0, 25))]
    if rng.random() < 0.5:
        tags += ["%%", "|||"] * int(rng.integers(0, 2))
        tags = [tags[i] for i in rng.permutation(len(tags))]
    maybe = lambda s: s if rng.random() < 0.7 else rng.choice([None, ""])  # noqa: E731
    meta = None
    if rng.random() < 0.6:
        values = [text(0, 6), int(rng.integers(-999, 999)), 0.25, True, None,
                  [text(1, 4) for _ in range(rng.integers(0, 4))], {"k": text(0, 3), "a": [1]}]
        meta = {f"k{text(0, 3)}": values[rng.integers(len(values))]
                for _ in range(rng.integers(0, 5))}
    return Row("x", tags=tags if rng.random() < 0.9 else None, caption_nl=maybe(text(1, 40)),
               artist=maybe(text(1, 10)), rating=maybe(text(1, 6)), json=meta)


ESTIMATED = [
    {"template": "tags"},
    {"template": "tags", "keep": ["artist", "rating", "tags", "caption_nl"], "keep_first": 2,
     "joiner": " ; ", "prefix": "pre: ", "suffix": " end", "tag_dropout": 0.2},
    {"template": "tags", "joiner": "", "keep": [], "underscores": False, "unescape": False},
    {"template": "nl", "keep": ["rating", "tags"]},
    {"template": "nl", "fallback": {"template": "json"}},
    {"template": "mix", "nl": {"keep": ["artist"]}, "tags": {"joiner": " || ", "keep": ["tags"]}},
    {"template": "json"},
    {"template": "json", "order": ["rating"], "field_dropout": 0.3, "keep": ["tags"]},
    {"template": "json", "style": "json"},
    {"template": "json", "style": "json", "fields": ["tags"]},
]


@pytest.mark.parametrize("config", ESTIMATED, ids=lambda c: json.dumps(c, sort_keys=True))
def test_estimate_is_an_upper_bound(config):
    t = parse_template(config, WHERE)
    # JSON-style output escapes quotes and backslashes of row fields, which the
    # character columns cannot see; those rows use an alphabet without them.
    alphabet = PLAIN if "\"style\": \"json\"" in json.dumps(config) else ALPHABET
    rng = np.random.default_rng(1234)
    rows = [random_row(rng, alphabet) for _ in range(300)]
    est = estimate_caption_chars(t, char_columns(rows))
    assert est.dtype == np.int64 and est.shape == (300,)
    for i, row in enumerate(rows):
        for v in range(3):
            cap = render_caption(t, row, 0, i, v)
            assert len(cap) <= est[i], (row, cap)


def test_estimate_formulas_match_spec_for_defaults():
    rows = [Row("x", tags=["ab", "cd"], artist="art", caption_nl="hello", rating="safe",
                json={"a": 1}), Row("y", tags=["q"])]
    cols = char_columns(rows)
    assert cols["tags_chars"].tolist() == [6, 1] and cols["json_chars"].tolist() == [7, 0]
    assert TagsTemplate().estimate_chars(cols).tolist() == [6 + 3 + 2, 1]
    assert NlTemplate(keep=("rating",)).estimate_chars(cols).tolist() == [5 + 4 + 2, 1]
    assert MixTemplate().estimate_chars(cols).tolist() == [11, 1]
    # json chars + per field (chars + len(name) + 3): artist, rating, tags, caption_nl
    lines = 7 + (3 + 6 + 3) + (4 + 6 + 3) + (6 + 4 + 3) + (5 + 10 + 3)
    assert JsonTemplate().estimate_chars(cols).tolist() == [lines, 1 + 4 + 3]


@settings(max_examples=150, deadline=None)
@given(tags=st.lists(st.text(alphabet="ab_\\()%|, é", max_size=6), max_size=20),
       artist=st.one_of(st.none(), st.text(max_size=8)),
       joiner=st.text(alphabet=",; |", max_size=4), keep_first=st.integers(0, 4),
       keep=st.lists(st.sampled_from(["artist", "tags", "rating"]), max_size=3),
       p=st.sampled_from([0.0, 0.5]), variant=st.integers(0, 3))
def test_tags_estimate_bound_property(tags, artist, joiner, keep_first, keep, p, variant):
    row = Row("x", tags=tags, artist=artist, rating="r")
    t = parse_template({"joiner": joiner, "keep_first": keep_first, "keep": keep,
                        "tag_dropout": p, "group_dropout": p}, WHERE)
    est = t.estimate_chars(char_columns([row]))
    assert len(render_caption(t, row, 1, 2, variant)) <= est[0]


def test_template_without_estimator_sums_columns():
    class Plain:
        pass

    row = Row("x", tags=["ab"], caption_nl="hey", artist="a", rating="r", json={"k": 1})
    cols = char_columns([row])
    assert estimate_caption_chars(Plain(), cols).tolist() == [2 + 3 + 1 + 1 + 7]


def test_estimate_text_tokens():
    assert estimate_text_tokens(0) == 12
    assert estimate_text_tokens(35) == 22
    assert estimate_text_tokens(36) == 23
    assert estimate_text_tokens(10**9) == 4096
    out = estimate_text_tokens(np.array([0, 1, 35, 10**7]), 3.5, 12, 4096)
    assert out.dtype == np.int64 and out.tolist() == [12, 13, 22, 4096]
    assert estimate_text_tokens(np.array([10]), 2.0, 0, 3).tolist() == [3]


# ---- text dropout ------------------------------------------------------------------------

def test_text_dropped():
    assert not any(text_dropped(0, i, 0, 0, 0.0) for i in range(50))
    assert all(text_dropped(0, i, 0, 0, 1.0) for i in range(50))
    drops = [text_dropped(3, i, r, s, 0.1) for i in range(200) for r in range(2) for s in range(5)]
    assert abs(np.mean(drops) - 0.1) < 0.02
    assert text_dropped(3, 4, 1, 2, 0.5) == (rng_of("text-drop", 3, 4, 1, 2).random() < 0.5)
    assert text_dropped(np.int64(3), 4, 1, 2, 0.5) == text_dropped(3, 4, 1, 2, 0.5)


# ---- parsing -------------------------------------------------------------------------------

def test_parse_defaults():
    assert parse_template({}, WHERE) == TagsTemplate()
    assert parse_template(None, WHERE) == TagsTemplate()
    assert parse_template({"template": "tags"}, WHERE) == TagsTemplate()
    mix = parse_template({"template": "mix", "nl": {"keep": ["artist"]}, "tags": None}, WHERE)
    assert mix == MixTemplate(nl=NlTemplate(keep=("artist",)))
    assert parse_template(mix, WHERE) is mix
    assert TagsTemplate().keep == ("artist",) and JsonTemplate().style == "lines"
    assert set(TEMPLATES) == {"tags", "nl", "mix", "json"}
    assert all(cls.name == name for name, cls in TEMPLATES.items())


@pytest.mark.parametrize("config, needles", [
    ({"template": "tags", "tag_dropoutt": 0.1},
     ["caption.template.tag_dropoutt", "did you mean 'tag_dropout'"]),
    ({"tag_dropout": 1.5}, ["caption.template.tag_dropout", "1.5", "[0, 1]"]),
    ({"group_dropout": -0.1}, ["caption.template.group_dropout", "-0.1"]),
    ({"template": "tag"}, ["caption.template.template", "'tag'", "tags, nl, mix, json"]),
    ({"template": "markdown"}, ["'markdown'", "tags, nl, mix, json"]),
    ({"template": "nl", "fallback": {"keep": ["artst"]}},
     ["caption.template.fallback.keep", "artst", "artist, rating, tags, caption_nl"]),
    ({"template": "mix", "tags": {"template": "nl", "fallback": {"joinr": " "}}},
     ["caption.template.tags.fallback.joinr", "did you mean 'joiner'"]),
    ({"template": "mix", "p_nl": 2}, ["caption.template.p_nl", "2"]),
    ({"template": "json", "style": "yaml"}, ["caption.template.style", "'lines'", "'json'"]),
    ({"template": "json", "fields": "tags"}, ["caption.template.fields", "a list"]),
    ({"keep_first": -1}, ["caption.template.keep_first", "-1"]),
    ({"shuffle": "yes"}, ["caption.template.shuffle", "true or false"]),
    ("tags", ["caption.template", "mapping"]),
])
def test_parse_errors_name_the_key(config, needles):
    with pytest.raises(ConfigError) as err:
        parse_template(config, WHERE)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


@pytest.mark.parametrize("config", [{}, *ESTIMATED,
                                    {"template": "mix", "nl": {"fallback": {"template": "mix"}}}])
def test_to_plain_round_trips(config):
    t = parse_template(config, WHERE)
    plain = to_plain(t)
    assert json.loads(json.dumps(plain)) == plain
    again = parse_template(plain, WHERE)
    assert again == t and to_plain(again) == plain and hash(again) == hash(t)
