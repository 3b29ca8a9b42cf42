#!/usr/bin/env bash
# The GPU check: on a machine with CUDA and NCCL, runs (at most 9 minutes by the timeouts below)
#   1. the CUDA-marked tests, `pytest -m cuda tests/`, at most 3 minutes: tests/test_cuda.py (a CPU-built model
#      moved to the GPU shard by shard at wrap, no unintended host sync in forward/backward/step, an in-place
#      optimizer against prefetched all-gathers over many steps, placement of parameters, buffers, gradients,
#      optimizer state), tests/test_cuda_comm.py (CUDA-event comm timing, fp16 averages on NCCL),
#      tests/test_cuda_mesh.py (a rank of a 2 x 4 mesh over the fake process group: shard shapes, the sync
#      debug mode, peak memory against FSDP2 on the same mesh), tests/test_cuda_races.py (real NCCL hops from the
#      hop stream, sleeps on every stream changing no bit, the CUDA sanitizer); any skipped CUDA test fails the
#      check (a check that skips is a check that did not run);
#   2. hsdp vs PyTorch FSDP2 on one GPU (benchmarks/gpu_smoke.py), at most 5 minutes: the ~1B GPT preset in
#      mixed bf16, same init and batches, 3 warm-up + 10 timed steps each; the losses must agree;
#   3. one result, benchmarks/results/gpu_check_<date>.{json,md} (benchmarks/gpu_check_report.py): the tests'
#      passed/failed/skipped counts and outcomes, the fake-mesh peak memory of hsdp and FSDP2, tokens/s, step
#      time and peak torch.cuda.max_memory_allocated per framework with their ratios, and the exact commands.
#      Written whether the steps passed or not; both steps run even when the first fails.
#
# The Python: $PY if set, else the first of python3, python, .venv/bin/python whose torch sees CUDA with NCCL
# (the tree's .venv may hold a CPU-only torch while the machine has a CUDA one); the tree goes on PYTHONPATH.
# Without CUDA it runs what a CPU can check (the CUDA tests collect; the smoke and report scripts import and parse
# their arguments), says that it checked nothing on a GPU and exits 0, or 3 with --require-gpu. Exit 4:
# nvidia-smi sees a GPU but no torch here has CUDA. Exit 6: a CUDA test was skipped. Otherwise the first failing
# step's exit code (pytest's 1 for a failed test, 124 for a step past its timeout, gpu_smoke's 1 when the losses
# disagree). Other arguments go to gpu_smoke.py, e.g. `bash benchmarks/gpu_check.sh --require-gpu --preset gpt2-124m`.
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
"$PY" -m pytest -q -p no:cacheprovider --collect-only -m cuda tests/ | tail -n 1
"$PY" benchmarks/gpu_smoke.py --help > /dev/null
"$PY" benchmarks/gpu_check_report.py --help > /dev/null
echo "gpu_smoke.py, gpu_check_report.py: import and arguments ok"

if [ -z "$cuda_py" ]; then
    if command -v nvidia-smi > /dev/null && nvidia-smi -L 2> /dev/null | grep -q '^GPU'; then
        echo "FAILED: nvidia-smi sees a GPU but no torch here has CUDA with NCCL (tried: $candidates); set PY= to a CUDA-enabled python" >&2
        exit 4
    fi
    echo "NOTHING CHECKED ON A GPU: no CUDA device with NCCL on this machine (the CUDA tests and the hsdp vs FSDP2 run need one)"
    [ "$require_gpu" = 1 ] && exit 3
    exit 0
fi
device=$("$PY" -c 'import torch; print(torch.cuda.device_count(), "x", torch.cuda.get_device_name(0), "torch", torch.__version__, "CUDA", torch.version.cuda)')
echo "CUDA: $device"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export HSDP_GPU_CHECK_DIR="$work"  # tests/test_cuda_mesh.py leaves its memory numbers there

echo "== CUDA tests (pytest -m cuda, at most 3 minutes)"
pytest_cmd=("$PY" -m pytest -q -p no:cacheprovider -m cuda -rs --junitxml "$work/pytest.xml" tests/)
set +e
# cuBLAS deterministic whatever the streams (tests/test_cuda_races.py compares runs bit for bit).
CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout -k 5 180 "${pytest_cmd[@]}" 2>&1 | tee "$work/pytest.log"
pytest_rc=${PIPESTATUS[0]}
set -e
skipped=0
if grep -Eq '[0-9]+ skipped' "$work/pytest.log"; then
    skipped=1
    echo "FAILED: CUDA tests were skipped (see the SKIPPED lines above): they checked nothing" >&2
fi

echo "== hsdp vs FSDP2 on one GPU (at most 5 minutes)"
smoke_cmd=("$PY" -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/gpu_smoke.py
           --preset gpt-1b --steps 13 --warmup 3 --out "$work/smoke" ${args[@]+"${args[@]}"})
set +e
timeout -k 5 300 "${smoke_cmd[@]}"
smoke_rc=$?
set -e

rc=0
if [ "$skipped" = 1 ]; then rc=6; elif [ "$pytest_rc" != 0 ]; then rc=$pytest_rc; elif [ "$smoke_rc" != 0 ]; then rc=$smoke_rc; fi
shown() { local s; s=$(printf '%q ' "$@"); s=${s% }; printf '%s' "${s//"$work"/<tmp>}"; }  # as run, tmp dir named
"$PY" benchmarks/gpu_check_report.py --out benchmarks/results --command "bash benchmarks/gpu_check.sh${*:+ $*}" \
    --device "$device" --exit-code "$rc" --junit "$work/pytest.xml" --pytest-command "$(shown "${pytest_cmd[@]}")" \
    --pytest-rc "$pytest_rc" --memory "$work/fake_mesh_memory.json" --smoke-dir "$work/smoke" \
    --smoke-command "$(shown "${smoke_cmd[@]}")" --smoke-rc "$smoke_rc" \
    || echo "WARNING: benchmarks/gpu_check_report.py could not write the result file" >&2
if [ "$rc" = 0 ]; then echo "GPU check passed"; else echo "GPU check FAILED (exit $rc)" >&2; fi
exit "$rc"
