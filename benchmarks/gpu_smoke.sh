#!/usr/bin/env bash
# hsdp vs PyTorch FSDP2 on one CUDA GPU (NCCL): same init, same data; checks the losses agree and writes
# benchmarks/results/gpu_smoke_<date>.{json,md}. Extra arguments go to gpu_smoke.py (see its --help).
set -euo pipefail
torchrun --standalone --nproc-per-node 1 "$(dirname "$0")/gpu_smoke.py" "$@"
