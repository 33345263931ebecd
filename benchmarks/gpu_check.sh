#!/usr/bin/env bash
# The 11B-shaped skeleton on one CUDA GPU: a few QAT steps (FSDP2, bf16) and a teacher-generate shard; writes
# throughput (steps/s, tokens/s) and torch.cuda.max_memory_allocated per phase to a JSON
# ($OUT/gpu_check.json, else checkpoints/skeleton-11b/gpu_check.json; --out FILE to choose).
#   benchmarks/gpu_check.sh [--steps 4] [--batch 4] [--seq 512] [--gen-prompts 8] [--gen-tokens 64] [--fit]
# Exits 2 with a message when no GPU is visible. See benchmarks/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" benchmarks/gpu_check.py "$@"
