#!/usr/bin/env bash
# The GPU check: on a machine with CUDA and NCCL, runs
#   1. the CUDA-marked tests, `pytest -m cuda tests/` (tests/test_cuda.py: a CPU-built model moved to the GPU
#      shard by shard at wrap, no unintended host sync in forward/backward/step, an in-place optimizer against
#      prefetched all-gathers over many steps, placement of parameters, buffers, gradients, optimizer state);
#      any skipped CUDA test fails the check (a check that skips is a check that did not run);
#   2. hsdp vs PyTorch FSDP2 on one GPU (benchmarks/gpu_smoke.py): the ~1B GPT preset in mixed bf16, same init
#      and batches, 3 warm-up + 10 timed steps each; the losses must agree; tokens/s and peak
#      torch.cuda.max_memory_allocated per framework go to benchmarks/results/gpu_smoke_<date>.{json,md}.
# About 5 minutes on one H200-class GPU (at most 3 + 6 by the timeouts below).
#
# The Python: $PY if set, else the first of python3, python, .venv/bin/python whose torch sees CUDA with NCCL
# (the tree's .venv may hold a CPU-only torch while the machine has a CUDA one); the tree goes on PYTHONPATH.
# Without CUDA it runs what a CPU can check (the CUDA tests collect; the smoke script imports and parses its
# arguments), says that it checked nothing on a GPU and exits 0, or 3 with --require-gpu. Exit 4: nvidia-smi
# sees a GPU but no torch here has CUDA. Exit 6: a CUDA test was skipped. Other arguments go to gpu_smoke.py,
# e.g. `bash benchmarks/gpu_check.sh --require-gpu --preset gpt2-124m`.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
require_gpu=0
args=()
for a in "$@"; do
    if [ "$a" = --require-gpu ]; then require_gpu=1; else args+=("$a"); fi
done

has_cuda() { "$1" -c 'import sys, torch, torch.distributed as d
sys.exit(not (torch.cuda.is_available() and d.is_nccl_available()))' 2> /dev/null; }
candidates=${PY:-python3 python .venv/bin/python}
cuda_py=""
for candidate in $candidates; do
    if command -v "$candidate" > /dev/null && has_cuda "$candidate"; then cuda_py=$candidate; break; fi
done
PY=${cuda_py:-${PY:-.venv/bin/python}}
[ -x "$PY" ] || command -v "$PY" > /dev/null || PY=python3
echo "== Python: $(command -v "$PY") (torch $("$PY" -c 'import torch; print(torch.__version__)'))"

echo "== CPU checks"
"$PY" -m pytest -q -p no:cacheprovider --collect-only -m cuda tests/test_cuda.py | tail -n 1
"$PY" benchmarks/gpu_smoke.py --help > /dev/null
echo "gpu_smoke.py: imports and arguments ok"

if [ -z "$cuda_py" ]; then
    if command -v nvidia-smi > /dev/null && nvidia-smi -L 2> /dev/null | grep -q '^GPU'; then
        echo "FAILED: nvidia-smi sees a GPU but no torch here has CUDA with NCCL (tried: $candidates); set PY= to a CUDA-enabled python" >&2
        exit 4
    fi
    echo "NOTHING CHECKED ON A GPU: no CUDA device with NCCL on this machine (the CUDA tests and the hsdp vs FSDP2 run need one)"
    [ "$require_gpu" = 1 ] && exit 3
    exit 0
fi
"$PY" -c 'import torch; print("CUDA:", torch.cuda.device_count(), "x", torch.cuda.get_device_name(0), "torch", torch.__version__)'

echo "== CUDA tests (pytest -m cuda)"
log=$(mktemp)
timeout 180 "$PY" -m pytest -q -p no:cacheprovider -m cuda -rs tests/ | tee "$log"
if grep -Eq '[0-9]+ skipped' "$log"; then
    echo "FAILED: CUDA tests were skipped (see the SKIPPED lines above): they checked nothing" >&2
    exit 6
fi

echo "== hsdp vs FSDP2 on one GPU"
timeout 360 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/gpu_smoke.py \
    --preset gpt-1b --steps 13 --warmup 3 ${args[@]+"${args[@]}"}
echo "GPU check passed"
