#!/usr/bin/env bash
# Wheels the offline kit (../shared/gpu-offline) lacks, for the GPU machine (Python 3.12), into .gpu-extra/
# (git-ignored; after the kit's c01 and before `start`: bash bench/lease.sh stage .gpu-extra).
#   flash-linear-attention + fla-core: transformers' Gated DeltaNet kernels for Qwen3.5's linear-attention
#     layers on the trainer side. Without them transformers falls back to its PyTorch reference
#     implementation: on the H200 (2026-12-01) one update of 8 x 12,000-token sequences of the random
#     Qwen3.5-4B took 76.5 s and 123 GiB at peak (bench/README.md). causal-conv1d has no wheel (it
#     compiles CUDA at install): its PyTorch fallback stays.
#   einops: needed by fla-core.
set -euo pipefail
out=${1:-.gpu-extra}
mkdir -p "$out"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  --dest "$out" "flash-linear-attention==0.6.0" "fla-core==0.6.0" "einops>=0.8"
ls -la "$out"
