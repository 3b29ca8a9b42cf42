#!/usr/bin/env bash
# The GPU check: on a machine with CUDA and NCCL, runs
#   1. the CUDA-marked tests, `pytest -m cuda tests/` (tests/test_cuda.py: a CPU-built model moved to the GPU
#      shard by shard at wrap, no unintended host sync in forward/backward/step, an in-place optimizer against
#      prefetched all-gathers over many steps, placement of parameters, buffers, gradients, optimizer state);
#   2. hsdp vs PyTorch FSDP2 on one GPU (benchmarks/gpu_smoke.py): the ~1B GPT preset in mixed bf16, same init
#      and batches, 3 warm-up + 10 timed steps each; the losses must agree; tokens/s and peak
#      torch.cuda.max_memory_allocated per framework go to benchmarks/results/gpu_smoke_<date>.{json,md}.
# About 5 minutes on one H200-class GPU (at most 3 + 6 by the timeouts below). Without CUDA it runs what a CPU
# can check (the CUDA tests collect; the smoke script imports and parses its arguments), says there is no CUDA
# and exits 0. Extra arguments go to gpu_smoke.py, e.g. `bash benchmarks/gpu_check.sh --preset gpt2-124m`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

echo "== CPU checks"
"$PY" -m pytest -q -p no:cacheprovider --collect-only -m cuda tests/test_cuda.py | tail -n 1
"$PY" benchmarks/gpu_smoke.py --help > /dev/null
echo "gpu_smoke.py: imports and arguments ok"

if ! "$PY" -c 'import sys, torch, torch.distributed as d; sys.exit(not (torch.cuda.is_available() and d.is_nccl_available()))'
then
    echo "no CUDA device with NCCL on this machine: the CUDA tests and the hsdp vs FSDP2 run need one; nothing more to do"
    exit 0
fi
"$PY" -c 'import torch; print("CUDA:", torch.cuda.device_count(), "x", torch.cuda.get_device_name(0), "torch", torch.__version__)'

echo "== CUDA tests (pytest -m cuda)"
timeout 180 "$PY" -m pytest -q -p no:cacheprovider -m cuda -rs tests/

echo "== hsdp vs FSDP2 on one GPU"
timeout 360 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/gpu_smoke.py \
    --preset gpt-1b --steps 13 --warmup 3 "$@"
echo "GPU check passed"
