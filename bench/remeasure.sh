#!/usr/bin/env bash
# The bars of docs/performance.md measured again on the GPU machine, each beside the same
# bench run on a baseline tree in the same call (so a fresh machine's clock, which has moved
# figures by up to ~2%, falls on both):
#
#   bash bench/remeasure.sh base TAR     # unpack a baseline tree (git archive REV kohakumoss bench)
#   bash bench/remeasure.sh train        # bf16 rank-32 LoRA at 16,800 and 8,400 tokens with the
#                                        # fa4 extra, bf16 and fp8 `fast` in one process
#   bash bench/remeasure.sh sample       # sampling 1024^2, 50 steps, CFG 3, batch 1
#   bash bench/remeasure.sh block        # per-block checkpointing at 16,800 tokens
#   bash bench/remeasure.sh memory       # the memory profiles' capped rows and a full finetune
#   bash bench/remeasure.sh tuning       # first-run tuning
#
# Each prints the bench's JSON and writes it under $OUT (NAME-head.json, NAME-base.json). The
# baseline's flags are its own commit's spelling (the tree before the engine contract:
# --bases, --checkpointing, --memory-profile, --full). Run after `device_kit.sh install` and
# `site`; without a baseline unpacked only this tree runs.
set -uo pipefail
cd "$(dirname "$0")/.."
KIT=$(bash bench/device_kit.sh path)
BASE=/tmp/base
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"

head_run() {  # head_run NAME SCRIPT ARGS...
    local name=$1 script=$2; shift 2
    echo "== head $name: $script $*"
    PYTHONPATH=$KIT:. python3 "bench/$script" "$@" --name "$name-head" || echo "!! head $name failed"
}

base_run() {  # base_run NAME SCRIPT ARGS...
    local name=$1 script=$2; shift 2
    [[ -d $BASE/kohakumoss ]] || return 0
    echo "== base $name: $script $*"
    (cd "$BASE" && PYTHONPATH=$KIT:$BASE python3 "bench/$script" "$@" --name "$name-base") \
        || echo "!! base $name failed"
}

FA4=(--kernels fa4 triton compile)
case "${1:-}" in
    base)
        rm -rf "$BASE" && mkdir -p "$BASE" && tar xzf "$2" -C "$BASE" && ls "$BASE" ;;
    train)
        head_run train bench_train.py --budgets 16800 8400 "${FA4[@]}" \
            --variant "" --variant "precision.base=fp8 precision.fp8_compute=fast"
        base_run train bench_train.py --budgets 16800 8400 "${FA4[@]}" --bases keep fp8-full-fast ;;
    sample)
        head_run sample bench_sample.py --steps 50 --batches 1 --no-vae --kernels fa4 triton
        base_run sample bench_sample.py --steps 50 --batches 1 --no-vae --kernels fa4 triton ;;
    block)
        head_run block bench_train.py --budgets 16800 "${FA4[@]}" \
            -S profile=manual -S memory.checkpointing=block
        base_run block bench_train.py --budgets 16800 "${FA4[@]}" --checkpointing block ;;
    memory)
        head_run minimal bench_train.py --budgets 4200 16800 --kernels triton compile \
            -S profile=minimal --cap 6
        head_run balanced bench_train.py --budgets 16800 --kernels triton compile -S profile=balanced
        head_run full bench_train.py --budgets 4200 --steps 3 -S adapter.algo=full -S profile=low --cap 24
        base_run minimal bench_train.py --budgets 4200 16800 --kernels triton compile \
            --memory-profile minimal --cap 6 ;;
    tuning)
        PYTHONPATH=$KIT:. python3 bench/bench_tuning.py --budget-s 60 ;;
    *)
        sed -n 2,17p "$0"; exit 2 ;;
esac
