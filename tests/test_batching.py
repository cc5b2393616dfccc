"""Over-long fit and the packers of ``docs/data.md#batching``."""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kohakumoss.data.batching import (Fit, fit_overlong, keep_seed, kept_token_indices,
                                      pack_count, pack_ffd, pack_greedy)
from kohakumoss.seeding import rng_of, seed_of

# -- references: the documented loops (docs/data.md#packers), written plainly ------------


def greedy_reference(tokens, max_tokens, max_samples):
    cap = max_samples or float("inf")
    batches, cur, used = [], [], 0
    for i, t in enumerate(tokens):
        if cur and (used + t > max_tokens or len(cur) >= cap):
            batches.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += t
    if cur:
        batches.append(cur)
    return batches


def ffd_reference(tokens, max_tokens, max_samples, window):
    cap = max_samples or float("inf")
    out = []
    for start in range(0, len(tokens), window):
        idx = sorted(range(start, min(start + window, len(tokens))), key=lambda i: (-tokens[i], i))
        bins, room = [], []
        for i in idx:
            for b, items in enumerate(bins):
                if room[b] >= tokens[i] and len(items) < cap:
                    items.append(i)
                    room[b] -= tokens[i]
                    break
            else:
                bins.append([i])
                room.append(max_tokens - tokens[i])
        out.extend(bins)
    return out


# -- property tests ------------------------------------------------------------------------


@st.composite
def streams(draw):
    max_tokens = draw(st.integers(2, 5000))
    tokens = draw(st.lists(st.integers(1, max_tokens), max_size=300))
    max_samples = draw(st.integers(0, 8))
    return tokens, max_tokens, max_samples


def check_batches(batches, tokens, max_tokens, max_samples):
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(tokens)))  # every item exactly once
    for b in batches:
        assert b, "no empty batch"
        assert sum(tokens[i] for i in b) <= max_tokens
        if max_samples:
            assert len(b) <= max_samples


@settings(max_examples=300, deadline=None)
@given(streams())
def test_greedy_properties(stream):
    tokens, max_tokens, max_samples = stream
    batches = pack_greedy(tokens, max_tokens, max_samples)
    check_batches(batches, tokens, max_tokens, max_samples)
    assert [i for b in batches for i in b] == list(range(len(tokens)))  # order preserved
    assert batches == greedy_reference(tokens, max_tokens, max_samples)


@settings(max_examples=300, deadline=None)
@given(streams(), st.integers(1, 64))
def test_ffd_properties(stream, window):
    tokens, max_tokens, max_samples = stream
    batches = pack_ffd(tokens, max_tokens, max_samples, window)
    check_batches(batches, tokens, max_tokens, max_samples)
    assert batches == ffd_reference(tokens, max_tokens, max_samples, window)
    assert batches == pack_ffd(np.array(tokens, dtype=np.int64), max_tokens, max_samples, window)
    for b in batches:  # a bin never spans two windows
        assert len({i // window for i in b}) == 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 100), max_size=100), st.integers(1, 50), st.integers(0, 5))
def test_greedy_with_oversize_and_zero_items_matches_reference(tokens, max_tokens, max_samples):
    assert pack_greedy(tokens, max_tokens, max_samples) == greedy_reference(
        tokens, max_tokens, max_samples)
    assert pack_ffd(tokens, max_tokens, max_samples, 16) == ffd_reference(
        tokens, max_tokens, max_samples, 16)


# -- examples -----------------------------------------------------------------------------


def test_greedy_keeps_final_partial_batch():
    assert pack_greedy([3, 3, 3, 3, 1], 6, 0) == [[0, 1], [2, 3], [4]]
    assert pack_greedy([1, 1, 1, 1, 1], 100, 2) == [[0, 1], [2, 3], [4]]
    assert pack_greedy([], 10, 0) == []
    assert pack_greedy([50, 1], 10, 0) == [[0], [1]]  # an oversize item sits alone


def test_ffd_example():
    # sorted: 6@1, 5@3, 4@0, 3@4, 2@2; first fit gives bins [1, 0] and [3, 4, 2]
    tokens = [4, 6, 2, 5, 3]
    assert pack_ffd(tokens, 10, 0, 256) == [[1, 0], [3, 4, 2]]
    assert pack_ffd(tokens, 10, 2, 256) == [[1, 0], [3, 4], [2]]
    assert pack_ffd(tokens, 10, 0, 2) == [[1, 0], [3, 2], [4]]
    ties = [5, 5, 5, 5]
    assert pack_ffd(ties, 10, 0, 256) == [[0, 1], [2, 3]]


def test_ffd_deterministic():
    tokens = np.random.default_rng(0).integers(100, 4000, size=2000)
    a = pack_ffd(tokens, 8192, 4, 256)
    assert a == pack_ffd(tokens.copy(), 8192, 4, 256)
    assert a == pack_ffd(tokens.tolist(), 8192, 4, 256)


def test_packers_cover_a_large_stream():
    tokens = np.random.default_rng(0).integers(300, 4400, size=100_000)
    greedy = pack_greedy(tokens, 16384, 0)
    ffd = pack_ffd(tokens, 16384, 0, 256)
    assert sum(map(len, greedy)) == sum(map(len, ffd)) == 100_000
    assert len(ffd) <= len(greedy)


@pytest.mark.parametrize("n, bs, drop_last, sizes, unbatched", [
    (10, 4, True, [4, 4], 2),
    (10, 4, False, [4, 4, 2], 0),
    (8, 4, True, [4, 4], 0),
    (3, 4, True, [], 3),
    (3, 4, False, [3], 0),
    (0, 4, False, [], 0),
])
def test_pack_count(n, bs, drop_last, sizes, unbatched):
    batches, left = pack_count(n, bs, drop_last)
    assert [len(b) for b in batches] == sizes and left == unbatched
    assert [i for b in batches for i in b] == list(range(n - unbatched))


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_tokens"):
        pack_greedy([1], 0, 0)
    with pytest.raises(ValueError, match="max_samples"):
        pack_ffd([1], 10, -1, 4)
    with pytest.raises(ValueError, match="window"):
        pack_ffd([1], 10, 0, 0)
    with pytest.raises(ValueError, match=">= 0"):
        pack_greedy([1, -2], 10, 0)
    with pytest.raises(ValueError, match="batch_size"):
        pack_count(4, 0, True)


# -- over-long fit --------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["drop", "truncate_text", "drop_tokens"])
def test_fitting_samples_pass_unchanged(policy):
    assert fit_overlong(4096, 100, 4196, policy) == Fit(4096, 100, None, None)
    assert fit_overlong(10, 0, 10, policy) == Fit(10, 0)


def test_overlong_policies():
    assert fit_overlong(4096, 300, 4352, "drop") is None
    f = fit_overlong(4096, 300, 4352, "truncate_text")
    assert f == Fit(4096, 256, text_limit=256, img_keep=None) and f.tokens == 4352
    f = fit_overlong(4096, 300, 4352, "drop_tokens")
    assert f == Fit(4052, 300, text_limit=None, img_keep=4052) and f.tokens == 4352


@pytest.mark.parametrize("img, text, limit, policy, expected", [
    (4096, 10, 4096, "truncate_text", None),          # limit - image = 0 -> dropped
    (5000, 10, 4096, "truncate_text", None),          # limit - image < 0 -> dropped
    (4095, 10, 4096, "truncate_text", Fit(4095, 1, 1, None)),  # exactly one text token left
    (10, 4096, 4096, "drop_tokens", None),            # limit - text = 0 -> dropped
    (10, 4095, 4096, "drop_tokens", Fit(1, 4095, None, 1)),    # exactly one image token
    (1, 1, 1, "drop_tokens", None),
    (1, 1, 1, "truncate_text", None),
])
def test_overlong_edges(img, text, limit, policy, expected):
    assert fit_overlong(img, text, limit, policy) == expected


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 10000), st.integers(1, 10000), st.integers(2, 10000),
       st.sampled_from(["drop", "truncate_text", "drop_tokens"]))
def test_overlong_property(img, text, limit, policy):
    f = fit_overlong(img, text, limit, policy)
    if f is None:
        assert img + text > limit
        return
    assert f.img_tokens >= 1 and f.text_tokens >= 1 and f.tokens <= limit
    assert f.img_tokens <= img and f.text_tokens <= text
    if f.text_limit is not None:
        assert policy == "truncate_text" and f.text_tokens == f.text_limit < text
    if f.img_keep is not None:
        assert policy == "drop_tokens" and f.img_tokens == f.img_keep < img


def test_overlong_bad_input():
    with pytest.raises(ValueError, match="overlong"):
        fit_overlong(1, 1, 10, "squeeze")
    with pytest.raises(ValueError, match="img_tokens"):
        fit_overlong(0, 1, 10, "drop")


# -- kept token indices ----------------------------------------------------------------------


def test_kept_token_indices():
    ks = keep_seed(0, 3, 17, 12345)
    assert ks == seed_of("img-keep", 0, 3, 17, 12345)
    assert keep_seed(np.int64(0), np.int64(3), np.int64(17), np.int64(12345)) == ks
    idx = kept_token_indices(4096, 4000, ks)
    assert idx.dtype == np.int64 and idx.shape == (4000,)
    assert np.all(np.diff(idx) > 0) and idx[0] >= 0 and idx[-1] < 4096
    assert np.array_equal(idx, kept_token_indices(4096, 4000, ks))
    assert np.array_equal(idx, kept_token_indices(4096, 4000, np.uint64(ks)))
    expected = np.sort(rng_of("img-keep", ks).choice(4096, 4000, replace=False))
    assert np.array_equal(idx, expected)
    assert not np.array_equal(idx, kept_token_indices(4096, 4000, ks + 1))
    assert np.array_equal(kept_token_indices(5, 5, ks), np.arange(5))
    with pytest.raises(ValueError):
        kept_token_indices(5, 0, ks)
    with pytest.raises(ValueError):
        kept_token_indices(5, 6, ks)
