#!/usr/bin/env bash
# The planner's acceptance matrix: `hsdp tune` on the emulated cluster (root: network namespaces and tc),
# 4 ranks (2 nodes x 2) and 8 ranks (4 nodes x 2) at 1 Gbit/s and 100 Mbit/s, GPT "small". Each run writes
# benchmarks/results/tune_<date>_<tag>.{md,json,png}. About half an hour on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=benchmarks/results
FAST=(-m hsdp.tools.planner.workload --preset small --steps 6 --warmup 2)
SLOW=(-m hsdp.tools.planner.workload --preset small --steps 4 --warmup 1)  # link-bound: steady, and slow

$PY -m hsdp tune --nodes 2 --nproc-per-node 2 --inter-node-bandwidth 1gbit --repeats 3 \
    --out $OUT --tag 4ranks_1gbit -- "${FAST[@]}"
$PY -m hsdp tune --nodes 2 --nproc-per-node 2 --inter-node-bandwidth 100mbit --repeats 2 \
    --out $OUT --tag 4ranks_100mbit -- "${SLOW[@]}"
$PY -m hsdp tune --nodes 4 --nproc-per-node 2 --inter-node-bandwidth 1gbit --repeats 2 \
    --out $OUT --tag 8ranks_1gbit -- "${FAST[@]}"
$PY -m hsdp tune --nodes 4 --nproc-per-node 2 --inter-node-bandwidth 100mbit --repeats 2 \
    --out $OUT --tag 8ranks_100mbit -- "${SLOW[@]}"
