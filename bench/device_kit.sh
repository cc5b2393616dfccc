#!/usr/bin/env bash
# The wheels the GPU machine lacks, packed for it (its runs carry at most 64 MiB of ignored
# files a call, and nothing can be installed there from the network):
#
#   bash bench/device_kit.sh build      # here: .kit/fa4a and .kit/fa4b (flash-attn-4 with
#                                       # NVIDIA's CuTe DSL, the cu13 libraries split in two),
#                                       # .kit/whl (diffusers, for the VAE of bench_sample.py),
#                                       # .kit/lyc (lycoris-lora, einops, toml: the machine lacks them)
#   bash bench/device_kit.sh keep DIR   # there, in each call that carried one part: copy it
#                                       # to /tmp/kit (kept while the machine stays warm)
#   bash bench/device_kit.sh install    # there, once both halves are kept: reassemble and
#                                       # install into /tmp/fa4site
#   bash bench/device_kit.sh site       # there, in a call that carried .kit/lyc (and .kit/whl):
#                                       # install them into /tmp/site
#   export PYTHONPATH=$(bash bench/device_kit.sh path):.   # then run the benches
#
# A --target install runs no .pth file, so `path` names the CuTe DSL's package folder (which
# nvidia-cutlass-dsl's .pth would add to sys.path) beside the two install folders.
#
# The versions are the ones measured in docs/performance.md: flash-attn-4
# 4.0.0b40, nvidia-cutlass-dsl 4.8.1 with its cu13 libraries, for the machine's Python 3.12.
set -euo pipefail

FA4=("flash-attn-4==4.0.0b40" "nvidia-cutlass-dsl==4.8.1" "nvidia-cutlass-dsl-libs-base==4.8.1"
     "nvidia-cutlass-dsl-libs-core==4.8.1" "nvidia-cutlass-dsl-libs-cu13==4.8.1"
     "apache-tvm-ffi>=0.1.11,<0.2" "torch-c-dlpack-ext" "quack-kernels==0.6.5" "einops")
# (the CuTe DSL's cuda-bindings and protobuf are in the machine's image)
PARTS=(fa4a fa4b)
PART=50m  # a half each: with the tree and .kit/lyc under the 64 MiB a call carries

build() {
    local root tmp
    root=$(git rev-parse --show-toplevel)/.kit
    tmp=$(mktemp -d)
    rm -rf "$root"/fa4* "$root/whl" "$root/lyc" && mkdir -p "$root/whl"
    pip download -q --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$tmp" "${FA4[@]}"
    (cd "$tmp" && tar cf - ./*.whl | split -b "$PART" - "$root/fa4-part.")
    local parts=("$root"/fa4-part.*) i
    if (( ${#parts[@]} != ${#PARTS[@]} )); then
        echo "the FA4 wheels took ${#parts[@]} parts, not ${#PARTS[@]}: change PART" >&2; exit 1
    fi
    for i in "${!PARTS[@]}"; do mkdir -p "$root/${PARTS[$i]}" && mv "${parts[$i]}" "$root/${PARTS[$i]}/"; done
    pip download -q --no-deps -d "$root/whl" "diffusers>=0.36"
    mkdir -p "$root/lyc" && pip download -q --no-deps -d "$root/lyc" "lycoris-lora>=4.1.3" einops toml
    rm -rf "$tmp"
    du -sh "$root"/*
}

keep() {
    mkdir -p /tmp/kit && cp "$1"/fa4-part.* /tmp/kit/ && ls /tmp/kit
}

install() {
    local parts=(/tmp/kit/fa4-part.*)
    if (( ${#parts[@]} != ${#PARTS[@]} )); then
        echo "/tmp/kit holds ${#parts[@]} of the ${#PARTS[@]} parts: carry .kit/fa4a and .kit/fa4b (keep)" >&2
        exit 1
    fi
    rm -rf /tmp/kit/wheels && mkdir -p /tmp/kit/wheels /tmp/fa4site
    cat "${parts[@]}" | tar xf - -C /tmp/kit/wheels
    python3 -m pip install -q --no-deps --upgrade --target /tmp/fa4site /tmp/kit/wheels/*.whl
    PYTHONPATH=$(path) python3 -c "import flash_attn.cute, cutlass; print('fa4 ok')"
}

site() {
    local root
    root=$(git rev-parse --show-toplevel 2>/dev/null || pwd)/.kit
    python3 -m pip install -q --no-deps --target /tmp/site "$root"/lyc/*.whl \
        $(ls "$root"/whl/*.whl 2>/dev/null) 2>&1 | grep -v "already exists" || true
    PYTHONPATH=/tmp/site python3 -c "import lycoris; print('site ok')"
}

path() {
    echo "/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages:/tmp/site"
}

case "${1:-}" in
    build) build ;;
    keep) keep "$2" ;;
    install) install ;;
    site) site ;;
    path) path ;;
    *) sed -n '2,22p' "$0"; exit 2 ;;
esac
