#!/bin/bash
# A/B of where the one-token S3D8 products prefetch their next block (S3D8_NEXT_PREFETCH=l1 / l2), interleaved,
# on this machine: s3d8_bench (cold weights, 1 thread) on SmolLM2-135M's product shapes, for both x86 variants,
# then the lean runtime's decode on a packed SmolLM2 model beside a llama.cpp file (1 thread, fresh process each).
#   reports/kernels-next-prefetch/ab.sh PACKED_MODEL.safetensors LLAMA_CPP.gguf > reports/kernels-next-prefetch/ab.log
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
python native/build.py program s3d8_bench >/dev/null 2>&1
B=native/_build/$(cc -dumpmachine)/s3d8_bench
SHAPES=1x576x1536,1x1536x576,1x576x576,1x576x192,1x576x49152
grep -m1 "model name" /proc/cpuinfo; date -u
echo "read probe, 1 GiB, 1 thread:"
python -c "
import time, torch
from pipeline import native
b = torch.ones(1 << 30, dtype=torch.uint8)
for _ in range(3):
    t = time.perf_counter(); native.read_bandwidth_probe(b); print(f'  {(1 << 30) / (time.perf_counter() - t) / 1e9:.1f} GB/s')"
for round in 1 2 3; do
  for v in avx512 avx2; do
    for h in l2 l1; do
      printf 'round %s %-6s %s  GMAC/s (%s): ' $round $v $h $SHAPES
      S3D8_NEXT_PREFETCH=$h $B --variant $v --shapes $SHAPES --threads 1 --ops s3d8 | grep -o 'gmacs=[0-9.]*' | cut -d= -f2 | tr '\n' ' '
      echo
    done
  done
done
speed() {  # impl path
  python -c "
import sys
from pipeline.bench.real_model import run_child
r = run_child({'task': 'speed', 'impl': sys.argv[1], 'path': sys.argv[2], 'threads': 1, 'prompt_tokens': 128,
               'new_tokens': 64, 'extra_bufts': True})
print(f\"decode {r.get('decode_tokens_per_s') or 0:.1f} tok/s, runtime {r.get('runtime')}\", r.get('error', ''))" "$@"
}
for round in 1 2 3; do
  for h in l2 l1; do echo -n "round $round ours $h: "; S3D8_NEXT_PREFETCH=$h speed lean "$1"; done
  echo -n "round $round llama.cpp $(basename "$2"): "; speed llama.cpp "$2"
done
