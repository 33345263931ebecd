"""DVC stage arm-bench: the paper's kernel table (SPEC section 8) measured on this machine.

    python stages/arm_bench.py                                   # params.yaml `bench`
    python stages/arm_bench.py --shapes 1x4096x14336 --threads 1,2 --out /tmp/bench

Times this library's S3D8, INT8 and bf16 products against torch's own paths (``pipeline.bench.kernels``)
and writes ``reports/bench.json`` (the metrics: GMAC/s, ratios, GB/s), ``reports/bench_machine.json``
(machine, load average, variant, versions, parameters), ``reports/bench.md`` and ``reports/bench.png``.
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: idle OpenMP workers sleep instead of spinning. Measured here with one
# other job on the 2 cores, S3D8 m = 1 on 2 threads: 7-10 GMAC/s spinning (a stalled barrier costs
# a scheduler time slice) against 25-29 passive, stage and C bench alike; on 1 thread the same.
# Set OMP_WAIT_POLICY in the environment to measure the other way; bench_machine.json records it.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import argparse  # noqa: E402
import time
from dataclasses import asdict
from pathlib import Path

from pipeline import params
from pipeline.bench import BenchParams
from pipeline.bench.kernels import metrics, run
from pipeline.bench.report import chart, markdown
from pipeline.io import write_json, write_text
from pipeline.stage import console, run_log, stage_errors, versions


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml", help="parameters file (section `bench`)")
    parser.add_argument("--shapes", help="comma-separated MxKxN, e.g. 1x4096x14336,128x4096x4096")
    parser.add_argument("--threads", help="comma-separated thread counts, e.g. 1,2")
    parser.add_argument("--repeats", type=int, help="timed rounds per shape")
    parser.add_argument("--variant", help="force a library variant")
    parser.add_argument("--hot", action="store_true", help="one weight copy (cache-resident when it fits)")
    parser.add_argument("--out", default="reports/bench.json",
                        help="metrics JSON path (the .md, .png and _machine.json go beside it), or a directory")
    args = parser.parse_args(argv)
    with stage_errors("arm-bench"):
        p = params.load(BenchParams, "bench", args.params)
        if args.shapes:
            p.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
        if args.threads:
            p.threads = [int(t) for t in args.threads.split(",")]
        if args.repeats:
            p.repeats = args.repeats
        if args.variant:
            p.variant = args.variant
        p.hot = p.hot or args.hot
        out = Path(args.out)
        if out.suffix != ".json":
            out = out / "bench.json"
        began = time.perf_counter()
        records, machine = run(p, log=lambda line: console.print(line, markup=False, soft_wrap=True))
        result = metrics(records)
        write_json(out, result)
        write_json(out.with_name(f"{out.stem}_machine.json"),
                   {"stage": "arm-bench", "machine": machine, "params": asdict(p), **versions()})
        write_text(out.with_suffix(".md"), markdown(records, result["summary"], machine, p))
        chart(records, out.with_suffix(".png"))
        run_log("arm-bench", seconds=round(time.perf_counter() - began, 1))


if __name__ == "__main__":
    main()
