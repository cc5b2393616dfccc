"""Cache keys, the sharded store, and the fills (with stand-in encoders)."""

from __future__ import annotations

import json

import pytest
import torch

from kohakumoss.cache.fill import fill_text, text_items
from kohakumoss.cache.keys import latent_key, text_hash, text_key
from kohakumoss.cache.store import CacheMiss, TensorStore, storage_round_trip


def test_key_vectors_from_the_spec():
    assert text_key("qwen3.5-9b/bf16/compute", "bf16", "") == "b8959cb45bc67bcf26ce748c79f9db20"
    assert text_key("qwen3.5-9b/bf16/compute", "bf16", "1girl, solo") == "5514513db459ecd5f4edcb4d871c7d3f"
    args = dict(content="abc:1024x768", encoder_key_id="flux2-vae/bf16", storage="bf16",
                target_hw=(768, 1024), crop_ltrb=(0, 0, 1024, 768), background="white",
                has_alpha=False, resample="lanczos", draw="mode")
    assert latent_key(flip=False, **args) == "44cfaa3c1ae9500c6a1edde43a5de735"
    assert latent_key(flip=True, **args) == "b94fdbdbfecc979a7d74d99d880023c2"


def test_every_key_part_changes_the_key():
    base = dict(content="c", encoder_key_id="flux2-vae/bf16", storage="bf16", target_hw=(64, 64),
                crop_ltrb=(0, 0, 64, 64), flip=False, background="white", has_alpha=True,
                resample="lanczos", draw="mode")
    k0 = latent_key(**base)
    for part, value in dict(content="d", encoder_key_id="flux2-vae/fp16", storage="fp8",
                            target_hw=(64, 48), crop_ltrb=(1, 0, 64, 64), flip=True,
                            background="black", resample="box", draw="sample").items():
        assert latent_key(**{**base, part: value}) != k0, part
    # the background only counts for images with alpha
    no_alpha = {**base, "has_alpha": False}
    assert latent_key(**no_alpha) == latent_key(**{**no_alpha, "background": "black"})
    t0 = text_key("e/bf16/compute", "bf16", "a cat")
    assert len({t0, text_key("e/fp16/compute", "bf16", "a cat"), text_key("e/bf16/int8/g0", "bf16", "a cat"),
                text_key("e/bf16/compute", "fp8", "a cat"), text_key("e/bf16/compute", "bf16", "a cat ")}) == 5
    assert text_hash("a", (1, 2)) == text_hash("a", "(1, 2)")


@pytest.mark.parametrize("storage", ["bf16", "fp16", "fp32", "fp8"])
def test_store_round_trip_and_shards(tmp_path, storage):
    store = TensorStore(tmp_path / "c", storage, shard_bytes=4000)
    data = {f"{i:032x}": torch.randn(5 + i, 16) for i in range(20)}
    for k, v in data.items():
        store.add(k, v)
    store.flush()
    shards = sorted(p.name for p in (tmp_path / "c").glob("shard-*.safetensors"))
    assert len(shards) > 2  # several shards, not one file per entry
    again = TensorStore(tmp_path / "c", storage)
    for k, v in data.items():
        got = again.get(k, torch.float32)
        assert got.shape == v.shape
        assert torch.equal(got, storage_round_trip(v, storage, torch.float32))  # hit == online miss
    assert again.lengths()[f"{3:032x}"] == 8
    assert again.verify() == []


def test_killed_fill_keeps_complete_shards_and_drops_orphans(tmp_path):
    store = TensorStore(tmp_path, "bf16", shard_bytes=1 << 30)
    store.add("a" * 32, torch.ones(3, 4))
    store.flush()
    # a shard written but never indexed (killed between the two renames) is an orphan
    (tmp_path / "shard-00007.safetensors").write_bytes(b"partial")
    store2 = TensorStore(tmp_path, "bf16")
    assert store2.verify() == [] and not (tmp_path / "shard-00007.safetensors").exists()
    assert "a" * 32 in store2


def test_corrupt_shard_is_dropped_and_re_encoded(tmp_path):
    calls = []

    class Enc:
        def encode(self, captions, batch, max_tokens):
            calls.append(list(captions))
            return [torch.full((len(c) + 1, 8), float(len(c))) for c in captions]

    store = TensorStore(tmp_path, "bf16", shard_bytes=60)
    items = {text_key("fake", "bf16", c): c for c in ["a", "bb", "ccc", "dddd"]}
    s = fill_text(store, items, Enc, batch=2, max_tokens=0)
    assert s.encoded == 4 and len(list(tmp_path.glob("shard-*"))) >= 2
    assert fill_text(TensorStore(tmp_path, "bf16"), items, Enc, 2, 0).encoded == 0  # all cached
    victim = sorted(tmp_path.glob("shard-*"))[0]
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF  # one flipped bit in the payload
    victim.write_bytes(bytes(raw))
    calls.clear()
    s = fill_text(TensorStore(tmp_path, "bf16", shard_bytes=60), items, Enc, 2, 0)
    assert s.dropped_shards == [victim.name] and 0 < s.encoded < 4
    fresh = TensorStore(tmp_path, "bf16")
    for key, c in items.items():
        assert torch.equal(fresh.get(key, torch.float32), torch.full((len(c) + 1, 8), float(len(c))))


def test_incremental_fill_and_lazy_encoder(tmp_path):
    made = []

    def factory():
        made.append(1)

        class Enc:
            def encode(self, captions, batch, max_tokens):
                return [torch.zeros(2, 4) for _ in captions]

        return Enc()

    store = TensorStore(tmp_path, "bf16")
    items = {text_key("fake", "bf16", c): c for c in ["x", "y"]}
    fill_text(store, items, factory, 8, 0)
    assert fill_text(TensorStore(tmp_path, "bf16"), items, factory, 8, 0).encoded == 0
    assert len(made) == 1  # nothing missing: the encoder was never built
    items[text_key("fake", "bf16", "z")] = "z"
    assert fill_text(TensorStore(tmp_path, "bf16"), items, factory, 8, 0).encoded == 1


def test_offline_miss_names_the_entry(tmp_path):
    store = TensorStore(tmp_path, "bf16")
    store.add("a" * 32, torch.ones(1, 2))
    store.flush()
    with pytest.raises(CacheMiss) as e:
        store.get_many(["a" * 32, "b" * 32], describe=lambda k: f"caption {k[:4]!r}",
                       rebuild="kmoss cache_text")
    msg = str(e.value)
    assert "1 of 2 entries" in msg and "caption 'bbbb'" in msg and "kmoss cache_text" in msg


def test_text_items_cover_used_captions_and_the_empty_one():
    import pyarrow as pa

    plan = pa.table({"caption": ["a", "b", "a", "c"], "text_drop": [False, True, False, False]})
    items = text_items(plan, "enc", "bf16")
    assert sorted(items.values()) == ["", "a", "c"]
    assert json.dumps(items)  # plain data


def test_entry_digests_name_the_content_not_the_layout(tmp_path):
    data = {f"{i:032x}": torch.randn(3 + i, 8) for i in range(6)}
    small, big = TensorStore(tmp_path / "s", "fp8", shard_bytes=100), TensorStore(tmp_path / "b", "fp8")
    for k, v in data.items():
        small.add(k, v)
    for k, v in reversed(data.items()):
        big.add(k, v)
    small.flush()
    big.flush()
    assert len(list((tmp_path / "s").glob("shard-*"))) > 2
    assert len(list((tmp_path / "b").glob("shard-*"))) == 1
    assert small.content_digest(data) == big.content_digest(reversed(list(data)))
    assert small.content_digest(list(data)[:3]) != small.content_digest(data)
    index = json.loads((tmp_path / "s" / "index.json").read_text())
    assert index["schema"] == 2 and all(len(e) == 3 for e in index["entries"].values())


def test_every_read_checks_the_entry_digest(tmp_path):
    from kohakumoss.errors import IntegrityError

    store = TensorStore(tmp_path, "bf16", stage="cache_text")
    store.add("a" * 32, torch.ones(64, 8))
    store.flush()
    shard = next(tmp_path.glob("shard-*"))
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0x01  # one bit of the payload
    shard.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match=f"{shard.name} is corrupt: entry a+ .*`kmoss cache_text`"):
        TensorStore(tmp_path, "bf16", stage="cache_text").get("a" * 32)


def test_shard_numbering_ignores_temp_files_and_foreign_names(tmp_path):
    (tmp_path / ".shard-00004.safetensors.k2j3.tmp").write_bytes(b"killed")
    (tmp_path / "shard-notes.safetensors").write_bytes(b"not ours")
    store = TensorStore(tmp_path, "bf16")
    store.add("a" * 32, torch.ones(1, 2))
    store.flush()
    assert sorted(json.loads((tmp_path / "index.json").read_text())["shards"]) == ["shard-00000.safetensors"]
    assert not (tmp_path / ".shard-00004.safetensors.k2j3.tmp").exists()  # swept under the lock
    assert store.verify() == [] and (tmp_path / "shard-notes.safetensors").exists()
