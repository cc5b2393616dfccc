#!/usr/bin/env bash
# The wheels the GPU machine lacks, packed for it (its runs carry at most 64 MiB of ignored
# files a call, and nothing can be installed there from the network):
#
#   bash bench/device_kit.sh build      # here: .kit/fa4a and .kit/fa4b (flash-attn-4 with
#                                       # NVIDIA's CuTe DSL, the cu13 libraries split in two),
#                                       # .kit/whl (diffusers, for the VAE of bench_sample.py)
#   bash bench/device_kit.sh keep DIR   # there, in each call that carried one half: copy it
#                                       # to /tmp/kit (kept while the machine stays warm)
#   bash bench/device_kit.sh install    # there, once both halves are kept: reassemble and
#                                       # install into /tmp/fa4site (then PYTHONPATH=/tmp/fa4site:.)
#
# The versions are the ones measured in docs/performance.md (the tenth pass on): flash-attn-4
# 4.0.0b40, nvidia-cutlass-dsl 4.8.1 with its cu13 libraries, for the machine's Python 3.12.
set -euo pipefail

FA4=("flash-attn-4==4.0.0b40" "nvidia-cutlass-dsl==4.8.1" "nvidia-cutlass-dsl-libs-base==4.8.1"
     "nvidia-cutlass-dsl-libs-cu13==4.8.1" "apache-tvm-ffi>=0.1.11,<0.2" "torch-c-dlpack-ext"
     "quack-kernels==0.6.5" "einops")
PART=50m  # each half well under the 64 MiB a call carries

build() {
    local root tmp
    root=$(git rev-parse --show-toplevel)/.kit
    tmp=$(mktemp -d)
    rm -rf "$root" && mkdir -p "$root/fa4a" "$root/fa4b" "$root/whl"
    pip download -q --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$tmp" "${FA4[@]}"
    (cd "$tmp" && tar cf - ./*.whl | split -b "$PART" - "$root/fa4-part.")
    local parts=("$root"/fa4-part.*)
    if (( ${#parts[@]} != 2 )); then
        echo "the FA4 wheels took ${#parts[@]} parts, not 2: change PART" >&2; exit 1
    fi
    mv "${parts[0]}" "$root/fa4a/" && mv "${parts[1]}" "$root/fa4b/"
    pip download -q --no-deps -d "$root/whl" "diffusers>=0.36"
    rm -rf "$tmp"
    du -sh "$root"/*
}

keep() {
    mkdir -p /tmp/kit && cp "$1"/fa4-part.* /tmp/kit/ && ls /tmp/kit
}

install() {
    local parts=(/tmp/kit/fa4-part.*)
    if (( ${#parts[@]} != 2 )); then
        echo "/tmp/kit holds ${#parts[@]} of the 2 parts: carry .kit/fa4a and .kit/fa4b (keep)" >&2; exit 1
    fi
    mkdir -p /tmp/kit/wheels /tmp/fa4site
    cat "${parts[@]}" | tar xf - -C /tmp/kit/wheels
    python3 -m pip install -q --no-deps --target /tmp/fa4site /tmp/kit/wheels/*.whl
    PYTHONPATH=/tmp/fa4site python3 -c "import flash_attn.cute, cutlass; print('fa4 ok')"
}

case "${1:-}" in
    build) build ;;
    keep) keep "$2" ;;
    install) install ;;
    *) sed -n '2,15p' "$0"; exit 2 ;;
esac
