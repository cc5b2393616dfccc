"""Manifests, hashes and atomic writes."""

from __future__ import annotations

import pytest

from kohakumoss.artifacts import (ArtifactError, atomic_path, atomic_write_text, code_version,
                                  hash_json, make_manifest, read_manifest, verify_files,
                                  write_manifest)


def test_hash_json_is_canonical():
    assert hash_json({"a": 1, "b": [1, 2]}) == hash_json({"b": [1, 2], "a": 1})
    assert hash_json({"a": 1}) != hash_json({"a": 2})


def test_atomic_write_leaves_old_file_on_failure(tmp_path):
    target = tmp_path / "x.txt"
    atomic_write_text(target, "old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["x.txt"]  # no temp file left behind


def test_manifest_roundtrip_and_identity(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"abc")
    m = make_manifest("thing", 1, params={"k": 1}, inputs={}, code="v1", directory=tmp_path,
                      files=["a.bin"])
    write_manifest(tmp_path, m)
    assert read_manifest(tmp_path, "thing") == m
    m_params = make_manifest("thing", 1, params={"k": 2}, inputs={}, code="v1", directory=tmp_path,
                             files=["a.bin"])
    assert m_params.key != m.key and m_params.content_hash == m.content_hash
    downstream = make_manifest("down", 1, params={}, inputs={"up": m}, code="v1",
                               directory=tmp_path, files=["a.bin"])
    (tmp_path / "a.bin").write_bytes(b"abd")
    changed = make_manifest("thing", 1, params={"k": 1}, inputs={}, code="v1", directory=tmp_path,
                            files=["a.bin"])
    assert changed.content_hash != m.content_hash
    downstream2 = make_manifest("down", 1, params={}, inputs={"up": changed}, code="v1",
                                directory=tmp_path, files=["a.bin"])
    assert downstream2.key != downstream.key
    assert verify_files(tmp_path, m) == ["a.bin"]


def test_read_manifest_errors_name_the_stage(tmp_path):
    with pytest.raises(ArtifactError, match="run `kmoss plan`"):
        read_manifest(tmp_path, "plan", made_by="plan")
    (tmp_path / "manifest.json").write_text("{broken")
    with pytest.raises(ArtifactError, match="not a valid manifest"):
        read_manifest(tmp_path, "plan")


def test_code_version_tracks_source():
    v = code_version("kohakumoss.seeding")
    assert v.startswith("0.") and v == code_version("kohakumoss.seeding")
    assert v != code_version("kohakumoss.data.plan")
