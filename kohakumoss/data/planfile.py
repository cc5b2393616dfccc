"""The plan artifact: one Parquet row per batch slot, a summary, and a manifest.

Directory layout (a DVC output)::

    <out>/plan.parquet    columns below, sorted by (batch, slot)
    <out>/validation.parquet  the held-out batches, the same columns (validation:)
    <out>/summary.json    statistics a person can read (docs/data.md#plan-summary)
    <out>/manifest.json   kind "plan"; its content_hash names the run's data order

``read_plan`` checks both files against the hashes the manifest records before reading.

Columns: ``batch`` global batch g; ``index``/``rank`` (g // world, g % world); ``step`` and
``micro`` (index // grad_accum, index % grad_accum); ``slot``; ``epoch``/``position`` in the
epoch order; ``dataset``/``row``/``uid`` catalog identity; ``src_w``/``src_h``; ``target_h``/
``target_w``; ``crop_l``/``crop_t``/``crop_r``/``crop_b``; ``flip``; ``variant``; ``caption``
(rendered, undropped); ``text_drop``; ``image_tokens``/``text_tokens`` planned;
``text_limit``/``img_keep`` (-1 = none); ``keep_seed``; ``loss_weight``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kohakumoss.artifacts import (ArtifactError, Manifest, atomic_path, atomic_write_json,
                                  code_version, make_manifest, read_manifest, write_manifest)
from kohakumoss.config import Params, stage_params
from kohakumoss.data.captions import text_dropped
from kohakumoss.data.catalogset import CatalogSet, check_files, load_catalogs
from kohakumoss.data.plan import EpochResult, Occurrence, Planner, budget_mode, total_batches

KIND = "plan"
SCHEMA = 2  # 2: validation.parquet beside plan.parquet
VALIDATION = "validation.parquet"  # the held-out batches (docs/training.md#validation)
PARAMS = ["run.seed", "data.datasets", "resolution", "caption", "batching", "train.steps",
          "train.grad_accum", "parallel.world_size", "validation.share", "validation.max_samples"]
CODE = ("kohakumoss.data.plan", "kohakumoss.data.planfile", "kohakumoss.data.captions",
        "kohakumoss.data.resolution", "kohakumoss.data.batching", "kohakumoss.seeding",
        "kohakumoss.data.catalogset", "kohakumoss.data.tokens")

I32, I64 = pa.int32(), pa.int64()
PLAN_SCHEMA = pa.schema([
    ("batch", I64), ("index", I64), ("rank", I32), ("step", I64), ("micro", I32), ("slot", I32),
    ("epoch", I32), ("position", I64), ("dataset", I32), ("row", I64), ("uid", I64),
    ("src_w", I32), ("src_h", I32), ("target_h", I32), ("target_w", I32),
    ("crop_l", I32), ("crop_t", I32), ("crop_r", I32), ("crop_b", I32), ("flip", pa.bool_()),
    ("variant", I32), ("caption", pa.string()), ("text_drop", pa.bool_()),
    ("image_tokens", I32), ("text_tokens", I32), ("text_limit", I32), ("img_keep", I32),
    ("keep_seed", pa.uint64()), ("loss_weight", pa.float32()),
])


def plan_table(p: Params, cs: CatalogSet, batches: list[list[Occurrence]],
               validation: bool = False) -> pa.Table:
    """The rows of ``batches``; ``validation``: the held-out batches (``validation.parquet``:
    one process reads them all, step 0, no text dropped)."""
    world, acc, seed, drop = p.parallel.world_size, p.train.grad_accum, p.run.seed, p.caption.text_drop
    if validation:
        world, drop = 1, 0.0
    occ = [o for b in batches for o in b]
    g = np.repeat(np.arange(len(batches), dtype=np.int64), [len(b) for b in batches])
    slot = np.concatenate([np.arange(len(b)) for b in batches]) if batches else np.zeros(0, np.int64)
    index, rank = g // world, g % world
    rows = np.array([o.row for o in occ], np.int64)
    box = np.array([o.box for o in occ], np.int64).reshape(-1, 4)
    target = np.array([o.target for o in occ], np.int64).reshape(-1, 2)
    dataset = cs.dataset[rows]
    loss_weight = np.array([d.loss_weight for d in cs.datasets], np.float32)
    cols = {
        "batch": g, "index": index, "rank": rank,
        "step": index * 0 if validation else index // acc, "micro": index * 0 if validation else index % acc,
        "slot": slot, "epoch": [o.epoch for o in occ], "position": [o.position for o in occ],
        "dataset": dataset, "row": cs.local[rows], "uid": cs.uid[rows],
        "src_w": cs.w[rows], "src_h": cs.h[rows], "target_h": target[:, 0], "target_w": target[:, 1],
        "crop_l": box[:, 0], "crop_t": box[:, 1], "crop_r": box[:, 2], "crop_b": box[:, 3],
        "flip": [o.flip for o in occ], "variant": [o.variant for o in occ],
        "caption": [o.caption for o in occ],
        "text_drop": [text_dropped(seed, i, r, s, drop)
                      for i, r, s in zip(index.tolist(), rank.tolist(), slot.tolist())],
        "image_tokens": [o.image_tokens for o in occ], "text_tokens": [o.text_tokens for o in occ],
        "text_limit": [o.text_limit for o in occ], "img_keep": [o.img_keep for o in occ],
        "keep_seed": [o.keep_seed for o in occ], "loss_weight": loss_weight[dataset],
    }
    return pa.table({f.name: pa.array(cols[f.name], type=f.type) for f in PLAN_SCHEMA},
                    schema=PLAN_SCHEMA)


def _quantiles(x: np.ndarray) -> dict[str, float]:
    if not len(x):
        return {}
    return {f"p{q}": float(np.percentile(x, q)) for q in (5, 25, 50, 75, 95)}


def summarize(p: Params, cs: CatalogSet, table: pa.Table, epochs: list[EpochResult]) -> dict[str, Any]:
    batch = table.column("batch").to_numpy()
    img = table.column("image_tokens").to_numpy().astype(np.int64)
    txt = table.column("text_tokens").to_numpy().astype(np.int64)
    n_batches = int(batch.max()) + 1 if len(batch) else 0
    joint = np.bincount(batch, weights=img + txt, minlength=n_batches)
    per_batch = np.bincount(batch, minlength=n_batches)
    sizes = Counter(zip(table.column("target_h").to_pylist(), table.column("target_w").to_pylist()))
    src_area = (table.column("crop_r").to_numpy() - table.column("crop_l").to_numpy()) * \
               (table.column("crop_b").to_numpy() - table.column("crop_t").to_numpy())
    tgt_area = table.column("target_h").to_numpy() * table.column("target_w").to_numpy()
    live = cs.live
    return {
        "rows": int(len(cs)), "live_rows": int(live.sum()),
        "expected_epoch_items": float(cs.weight.astype(np.float64).sum()),
        "epochs_planned": len(epochs),
        "epoch_items": [e.items for e in epochs],
        "overlong_dropped": [e.dropped for e in epochs],
        "overlong_fitted": [e.fitted for e in epochs],
        "unbatched": [e.unbatched for e in epochs],
        "batches": n_batches, "samples": int(len(batch)),
        "steps": p.train.steps, "grad_accum": p.train.grad_accum, "world_size": p.parallel.world_size,
        "token_budget": budget_mode(p), "max_tokens": p.batching.max_tokens,
        "mean_samples_per_batch": float(per_batch.mean()) if n_batches else 0.0,
        "mean_image_tokens_per_batch": float(img.sum() / max(n_batches, 1)),
        "mean_text_tokens_per_batch": float(txt.sum() / max(n_batches, 1)),
        "joint_tokens_per_batch": _quantiles(joint),
        "max_joint_tokens": int(joint.max()) if n_batches else 0,
        "budget_fill": float(joint.mean() / p.batching.max_tokens) if n_batches else 0.0,
        "text_dropped": int(np.sum(table.column("text_drop").to_numpy(zero_copy_only=False))),
        "upscaled_share": float(np.mean(tgt_area > src_area)) if len(batch) else 0.0,
        "distinct_sizes": len(sizes),
        "top_sizes": [{"h": h, "w": w, "samples": n} for (h, w), n in sizes.most_common(8)],
    }


def make_plan(params: Params, catalog_dir: str | Path, out: str | Path) -> tuple[Manifest, dict]:
    """Plan the whole run from the scan's catalogs into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cs = load_catalogs(catalog_dir, params.data.datasets)
    counter = None
    inputs: dict[str, Manifest] = {"catalog": cs.manifest}
    if budget_mode(params) == "exact":
        from kohakumoss.data.tokens import TokenCounter, tokenizer_identity

        counter = TokenCounter(params.caption.tokenizer, params.caption.max_text_tokens).count_many
    planner = Planner(params, cs, counter)
    batches, epochs = planner.plan_batches(total_batches(params))
    table = plan_table(params, cs, batches)
    with atomic_path(out / "plan.parquet") as tmp:
        pq.write_table(table, tmp, compression="zstd")
    held = plan_table(params, cs, planner.plan_validation(), validation=True)
    with atomic_path(out / VALIDATION) as tmp:
        pq.write_table(held, tmp, compression="zstd")
    summary = summarize(params, cs, table, epochs)
    summary["validation"] = {"held_out": int(planner.held.sum()), "samples": held.num_rows,
                             "batches": len(set(held.column("batch").to_pylist()))}
    atomic_write_json(out / "summary.json", summary)
    extra_params = {}
    if counter is not None:
        extra_params["tokenizer"] = tokenizer_identity(params.caption.tokenizer)
    manifest = make_manifest(
        KIND, SCHEMA, params={**stage_params(params, PARAMS), **extra_params}, inputs=inputs,
        code=code_version(*CODE), directory=out, files=["plan.parquet", VALIDATION, "summary.json"],
        info={"batches": summary["batches"], "samples": summary["samples"],
              "epochs": summary["epochs_planned"]})
    write_manifest(out, manifest)
    return manifest, summary


def read_validation(directory: str | Path) -> pa.Table:
    """The held-out batches of a plan read by ``read_plan`` (checked with it)."""
    path = Path(directory) / VALIDATION
    try:
        return pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise ArtifactError(f"{path} is unreadable ({e}); rebuild it with `kmoss plan` "
                            f"(or `dvc repro`)") from None


def read_plan(directory: str | Path) -> tuple[pa.Table, Manifest]:
    """The plan table and manifest; a missing, changed or unreadable file is a one-line
    error naming it and `kmoss plan`."""
    directory = Path(directory)
    manifest = read_manifest(directory, KIND, made_by="plan")
    check_files(directory, manifest, "plan")
    path = directory / "plan.parquet"
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise ArtifactError(f"{path} is unreadable ({e}); rebuild it with `kmoss plan` "
                            f"(or `dvc repro`)") from None
    if not table.schema.equals(PLAN_SCHEMA, check_metadata=False):
        raise ArtifactError(f"{path} has another layout than this version writes; rebuild it "
                            f"with `kmoss plan` (or `dvc repro`)")
    return table, manifest
