"""DVC stage arm-bench: the paper's kernel table (SPEC section 8) measured on this machine.

    python stages/arm_bench.py                                   # params.yaml `bench`
    python stages/arm_bench.py --shapes 1x4096x14336 --threads 1,2 --out /tmp/bench
    python stages/arm_bench.py --generate --models synthetic-1b --threads 1 --out /tmp/gen.json

Times this library's S3D8, INT8 and bf16 products against torch's own paths (``pipeline.bench.kernels``)
and writes ``reports/bench.json`` (the metrics: GMAC/s, ratios, GB/s), ``reports/bench_machine.json``
(machine, load average, variant, versions, parameters), ``reports/bench.md`` and ``reports/bench.png``.

``--generate`` instead runs the tokens/s benchmark (``pipeline.bench.generate``: every row a fresh process) and writes only its records to ``--out`` (default ``reports/bench_generate_records.json``):
``{"records": [{model, format, impl, threads, prompt_tokens, new_tokens, prefill_tokens_per_s,
decode_tokens_per_s, weight_bytes, peak_rss_mb}]}``. A row that fails is an error (exit 1), not a record.
For the full report (read bandwidth, goals, .md, .png) run ``python -m pipeline.bench.generate``.
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: idle OpenMP workers sleep instead of spinning, because with any other job on
# the cores a spinning worker holds a core the stalled barrier waits for, a whole scheduler time slice
# (README, "Kernels"). Set OMP_WAIT_POLICY in the environment to measure the other way; bench_machine.json
# records it.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

from pipeline.bench.arm_bench import main  # noqa: E402

if __name__ == "__main__":
    main()
