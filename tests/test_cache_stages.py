"""The cache stages end to end on the tiny encoders: exact entries, incremental, resumable."""

from __future__ import annotations

import pytest
import torch

from kohakumoss.cache import fill as fill_mod
from kohakumoss.cache.build import build_latent_cache, build_text_cache
from kohakumoss.cache.keys import text_key
from kohakumoss.cache.store import TensorStore
from kohakumoss.data.catalogset import load_catalogs
from kohakumoss.data.loader import PlanBatches, decode_image, to_model_range
from kohakumoss.data.planfile import make_plan, read_plan
from kohakumoss.data.scan import scan
from kohakumoss.encoders import VAE, TextEncoder

from conftest import make_params, write_image


def _params(ds, **over):
    sections = {"caption": {"tokenizer": "tiny", "text_drop": 0.3},
                "batching": {"max_tokens": 400, "overlong": "drop_tokens"},
                "encoders": {"device": "cpu", "text_dtype": "fp32", "vae_dtype": "fp32", "vae_batch": 3},
                "cache": {"dtype": "fp32", "shard_mb": 1}, "train": {"steps": 12}}
    for k, v in over.items():
        sections[k] = {**sections.get(k, {}), **v}
    return make_params([{"source": "kohya", "path": str(ds)}], **sections)


def _pipeline(tmp_path, p):
    scan(p, tmp_path / "catalog")
    make_plan(p, tmp_path / "catalog", tmp_path / "plan")
    return build_text_cache(p, tmp_path / "plan", tmp_path / "text"), \
        build_latent_cache(p, tmp_path / "plan", tmp_path / "catalog", tmp_path / "lat")


def test_caches_hold_exactly_what_training_reads(tmp_path, kohya_dataset):
    p = _params(kohya_dataset)
    (tm, ts), (lm, ls) = _pipeline(tmp_path, p)
    assert ts.encoded == ts.wanted and ls.encoded == ls.wanted > 0
    table, _ = read_plan(tmp_path / "plan")
    enc = TextEncoder.load("tiny", dtype="fp32")
    text = TensorStore(tmp_path / "text", "fp32")
    # every caption a batch reads is cached, equal to a fresh encoding, with the planned length
    batches = PlanBatches(tmp_path / "plan", p.data.datasets, p.resolution, tmp_path / "catalog")
    b = batches.batch(0)
    for caption in b.captions:
        cached = text.get(text_key(enc.key_id, "fp32", caption), torch.float32)
        fresh = enc.encode([caption])[0].float()
        assert cached.shape == fresh.shape and torch.allclose(cached, fresh, atol=1e-5)
    planned = {c: n for c, n, d in zip(table.column("caption").to_pylist(),
                                       table.column("text_tokens").to_pylist(),
                                       table.column("text_drop").to_pylist()) if not d}
    lengths = text.lengths()
    for c, n in planned.items():
        assert lengths[text_key(enc.key_id, "fp32", c)] == n  # exact budget == encoded length
    # a latent entry equals encoding the loader's pixels for that slot
    vae = VAE.load("tiny", dtype="fp32")
    lat = TensorStore(tmp_path / "lat", "fp32")
    items = fill_mod.latent_items(table, load_catalogs(tmp_path / "catalog", p.data.datasets),
                                  p, vae.key_id)
    assert len(items) == ls.wanted
    key, it = next(iter(items.items()))
    data = p.data.datasets[it.dataset].args.open(it.locator)
    px = to_model_range(decode_image(data, it.box, it.target, it.flip))[None]
    expect = vae.encode(px)[0].flatten(1).T
    assert torch.allclose(lat.get(key, torch.float32), expect, atol=1e-5)


def test_rerun_encodes_only_new_images_and_loads_no_encoder(tmp_path, kohya_dataset, monkeypatch):
    p = _params(kohya_dataset)
    _pipeline(tmp_path, p)
    loads = []
    real_load = VAE.load
    monkeypatch.setattr(VAE, "load", classmethod(lambda cls, *a, **k: loads.append(1) or real_load(*a, **k)))
    _, s = build_latent_cache(p, tmp_path / "plan", tmp_path / "catalog", tmp_path / "lat")
    assert s.encoded == 0 and loads == []  # fully cached: the VAE is never built
    write_image(kohya_dataset / "1_beta" / "new.png", 50, 30, seed=7)
    scan(p, tmp_path / "catalog")
    make_plan(p, tmp_path / "catalog", tmp_path / "plan")
    _, s = build_latent_cache(p, tmp_path / "plan", tmp_path / "catalog", tmp_path / "lat")
    assert s.encoded >= 1 and s.cached > 0 and s.encoded <= 2  # the new image's crop(s) only


def test_killed_cache_stage_resumes(tmp_path, kohya_dataset, monkeypatch):
    p = _params(kohya_dataset, cache={"dtype": "fp32", "shard_mb": 1})
    scan(p, tmp_path / "catalog")
    make_plan(p, tmp_path / "catalog", tmp_path / "plan")
    calls = {"n": 0}
    real_encode = VAE.encode

    def dying_encode(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("killed")
        return real_encode(self, *a, **k)

    monkeypatch.setattr(VAE, "encode", dying_encode)
    monkeypatch.setattr(TensorStore, "add", _flush_every_entry(TensorStore.add))
    with pytest.raises(KeyboardInterrupt):
        build_latent_cache(p, tmp_path / "plan", tmp_path / "catalog", tmp_path / "lat")
    kept = len(TensorStore(tmp_path / "lat", "fp32"))
    assert kept > 0  # completed shards survived the kill
    monkeypatch.setattr(VAE, "encode", real_encode)
    _, s = build_latent_cache(p, tmp_path / "plan", tmp_path / "catalog", tmp_path / "lat")
    assert s.cached == kept and s.encoded == s.wanted - kept


def _flush_every_entry(add):
    def wrapped(self, key, tensor):
        add(self, key, tensor)
        self.flush()

    return wrapped


def test_changing_the_encoder_dtype_makes_old_entries_unreachable(tmp_path, kohya_dataset):
    p = _params(kohya_dataset)
    (_, ts), _ = _pipeline(tmp_path, p)
    p16 = _params(kohya_dataset, encoders={"text_dtype": "bf16"})
    _, s = build_text_cache(p16, tmp_path / "plan", tmp_path / "text")
    assert s.cached == 0 and s.encoded == ts.wanted


@pytest.mark.parametrize("mode", ["offline", "online", "off"])
def test_training_reads_per_mode(tmp_path, kohya_dataset, mode):
    from kohakumoss.cache.build import text_identity, vae_identity
    from kohakumoss.cache.lookup import BatchCaches
    from kohakumoss.cache.store import CacheMiss

    p = _params(kohya_dataset)
    _pipeline(tmp_path, p)
    pm = _params(kohya_dataset, cache={"text": mode, "latents": mode})
    cs = load_catalogs(tmp_path / "catalog", p.data.datasets)
    caches = BatchCaches(pm, cs, tmp_path / "text", tmp_path / "lat", text_identity(pm), vae_identity(pm))
    batch = PlanBatches(tmp_path / "plan", p.data.datasets, p.resolution, tmp_path / "catalog").batch(1)
    text, lat = caches.read_text(batch), caches.read_latents(batch)
    if mode == "off":
        assert text is None and lat is None
        return
    assert len(text) == len(batch.captions) and len(lat) == len(batch.pixels)
    vae = VAE.load("tiny", dtype="fp32")
    fresh = vae.encode(batch.pixels[0][None])[0].flatten(1).T
    assert lat[0].dtype == torch.bfloat16  # reads return bf16, as the trainer consumes them
    assert torch.allclose(lat[0].float(), fresh.bfloat16().float(), atol=1e-2)  # the loader's pixels
    # a miss: offline names the entry; online returns None, then writes the batch back
    empty = BatchCaches(pm, cs, tmp_path / "text2", tmp_path / "lat2", text_identity(pm), vae_identity(pm))
    if mode == "offline":
        with pytest.raises(CacheMiss, match="kmoss cache_latents"):
            empty.read_latents(batch)
        return
    assert empty.read_latents(batch) is None
    keys = empty.latent_keys(batch)
    tokens = [vae.encode(px[None])[0].flatten(1).T for px in batch.pixels]
    used = empty.latents.write_back(keys, tokens)
    empty.flush()
    again = empty.read_latents(batch)
    assert all(torch.equal(a, b) for a, b in zip(used, again))  # a miss trains on what a hit reads


def test_manifest_records_content_not_the_fill(tmp_path, kohya_dataset):
    import json

    p = _params(kohya_dataset)
    (tm, ts), (lm, _) = _pipeline(tmp_path, p)
    for m in (tm, lm):
        assert m.schema == 2 and set(m.info) == {"encoder", "storage", "entries", "failed"}
        assert "index.json" not in m.files and "builds.json" not in m.files
    first = (tmp_path / "text" / "manifest.json").read_bytes()
    assert json.loads(first)["info"]["entries"] == ts.wanted
    _, again = build_text_cache(p, tmp_path / "plan", tmp_path / "text")
    assert again.encoded == 0 and (tmp_path / "text" / "manifest.json").read_bytes() == first


def _vae_folder(root, seed: int):
    from kohakumoss.encoders.vae import build_tiny

    vae = build_tiny()
    with torch.no_grad():
        for t in vae.parameters():
            t.add_(0.01 * torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)))
    vae.save_pretrained(root / "vae")
    return root


def test_other_weights_under_the_same_id_are_never_read(tmp_path, kohya_dataset, caplog):
    """Keys name the VAE by id (flux2-vae/fp32) only; the folder records which files filled
    it. Other weights at the same path: the fill starts the folder again, and training
    refuses a cache filled from other weights."""
    from kohakumoss.cache.build import check_sources
    from kohakumoss.errors import IntegrityError

    weights = _vae_folder(tmp_path / "pipe", seed=1)
    p = _params(kohya_dataset, model={"vae": str(weights)})
    _, (m1, s1) = _pipeline(tmp_path, p)
    check_sources(p, tmp_path / "text", tmp_path / "lat")  # the same weights: reads go ahead
    key = sorted(TensorStore(tmp_path / "lat", "fp32").index["entries"])[0]
    first = TensorStore(tmp_path / "lat", "fp32").get(key, torch.float32)
    _vae_folder(tmp_path / "pipe", seed=2)  # retrained in place: same path, same id
    with pytest.raises(IntegrityError, match=r"lat was filled from other flux2-vae weights .*"
                                             r"dvc repro -f cache_latents"):
        check_sources(p, tmp_path / "text", tmp_path / "lat")
    with caplog.at_level("WARNING"):
        m2, s2 = build_latent_cache(p, tmp_path / "plan", tmp_path / "catalog", tmp_path / "lat")
    assert "filled from other flux2-vae weights" in caplog.text
    assert s2.encoded == s1.encoded == s2.wanted  # everything again, nothing stale kept
    again = TensorStore(tmp_path / "lat", "fp32").get(key, torch.float32)
    assert not torch.equal(first, again) and m2.content_hash != m1.content_hash
    check_sources(p, tmp_path / "text", tmp_path / "lat")


def test_the_fingerprint_reads_samples_of_every_file(tmp_path):
    from kohakumoss.encoders.fingerprint import EDGE, fingerprint

    big = tmp_path / "a.safetensors"
    data = bytearray(torch.randint(0, 256, (4 * EDGE,), dtype=torch.uint8).numpy().tobytes())
    big.write_bytes(data)
    small = tmp_path / "b.json"
    small.write_text("{}")
    base = fingerprint([big, small])
    assert fingerprint([big, small]) == base and fingerprint([small, big]) != base
    for offset in (0, 4 * EDGE - 1, EDGE + (2 * EDGE) // 17):  # first MiB, last MiB, a block
        changed = bytearray(data)
        changed[offset] ^= 1
        big.write_bytes(changed)
        assert fingerprint([big, small]) != base, offset
    big.write_bytes(data)
    small.write_text("{} ")
    assert fingerprint([big, small]) != base  # a small file is read whole
