#!/usr/bin/env bash
# The 11B-shaped skeleton on one CUDA GPU: stage direct-cast's GPTQ cast on the GPU, a few QAT steps from it
# (FSDP2, bf16) and a teacher-generate shard; seconds and torch.cuda.max_memory_allocated per phase to a JSON
# ($OUT/gpu_check.json, else checkpoints/skeleton-11b/gpu_check.json; --out FILE to choose).
#   pipeline/bench/gpu_check.sh [--checks cast,qat,generate] [--algorithm gptq] [--steps 4] [--batch 4] [--seq 512]
#   pipeline/bench/gpu_check.sh --device cpu --preset tiny          # the same code without a GPU
#   pipeline/bench/gpu_check.sh --report RESULT.json... [--env MACHINE.txt]   # -> reports/gpu_check.{json,md}
# Exits 2 with a message when no GPU is visible. See pipeline/bench/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m pipeline.bench.gpu_check "$@"
