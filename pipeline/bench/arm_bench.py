"""The arm-bench stage's command line (``stages/arm_bench.py``, which sets ``OMP_WAIT_POLICY`` before torch loads):
the paper's kernel table (:mod:`pipeline.bench.kernels`, reports by :mod:`pipeline.bench.kernels_report`) or, with
``--generate``, the tokens/s records of :mod:`pipeline.bench.generate` run as a child process."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline import params
from pipeline.bench import BenchParams
from pipeline.bench.kernels import run
from pipeline.bench.kernels_report import write_reports
from pipeline.files.atomic import write_json
from pipeline.stage import console, run_log, stage_errors

STAGE_DOC = "DVC stage arm-bench: the paper's kernel table (SPEC section 8) measured on this machine."

GENERATE_KEYS = ("model", "format", "impl", "threads", "prompt_tokens", "new_tokens", "prefill_tokens_per_s",
                 "decode_tokens_per_s", "weight_bytes", "peak_rss_mb")
"""The fields of one ``--generate`` record, in order (``pipeline.bench.generate`` adds more; these are kept)."""
KERNEL_ONLY = ("shapes", "repeats", "variant", "hot")
GENERATE_ONLY = ("models", "formats", "impls", "prompt_tokens", "new_tokens")


def generate_records(args: argparse.Namespace) -> list[dict]:
    """Run ``python -m pipeline.bench.generate`` (a child process, its report in a scratch directory) and return its
    records cut to ``GENERATE_KEYS``; a failed row raises ``ValueError``. A child, not an import: the DVC stage never
    passes --generate, so the runtime is not among its deps."""
    argv = ["--models", args.models]
    for flag, value in (("--threads", args.threads), ("--formats", args.formats), ("--impls", args.impls),
                        ("--prompt-tokens", args.prompt_tokens), ("--new-tokens", args.new_tokens)):
        if value is not None:
            argv += [flag, str(value)]
    with tempfile.TemporaryDirectory(prefix="arm-bench-generate-") as scratch:
        proc = subprocess.run([sys.executable, "-m", "pipeline.bench.generate", *argv, "--out", scratch],
                              stdout=sys.stderr)
        result = Path(scratch) / "bench_generate.json"
        if proc.returncode or not result.is_file():
            raise ValueError(f"python -m pipeline.bench.generate {' '.join(argv)} failed (exit {proc.returncode})")
        data = json.loads(result.read_text())
    failed = [r for r in data["records"] if "error" in r]
    if failed:
        raise ValueError("; ".join(f"{r['model']} {r['format']} {r['impl']} {r['threads']}t: {r['error']}"
                                   for r in failed))
    if not data["records"]:
        raise ValueError(f"no generation records for --models {args.models}")
    return [{key: r[key] for key in GENERATE_KEYS} for r in data["records"]]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python stages/arm_bench.py", description=STAGE_DOC)
    parser.add_argument("--params", default="params.yaml", help="parameters file (section `bench`)")
    parser.add_argument("--shapes", help="comma-separated MxKxN, e.g. 1x4096x14336,128x4096x4096")
    parser.add_argument("--threads", help="comma-separated thread counts, e.g. 1,2")
    parser.add_argument("--repeats", type=int, help="timed rounds per shape")
    parser.add_argument("--variant", help="force a library variant")
    parser.add_argument("--hot", action="store_true", help="one weight copy (cache-resident when it fits)")
    parser.add_argument("--out", help="metrics JSON path (the .md, .png and _machine.json go beside it), or a "
                        "directory; default reports/bench.json (with --generate: reports/bench_generate_records.json, "
                        "the records alone)")
    gen = parser.add_argument_group("tokens/s benchmark (--generate)")
    gen.add_argument("--generate", action="store_true",
                     help="run pipeline.bench.generate instead of the kernel table and write its records to --out")
    gen.add_argument("--models", help="comma-separated models: toy, synthetic-tiny, synthetic-1b, synthetic-3b "
                     "(default toy,synthetic-1b)")
    gen.add_argument("--formats", help="comma-separated formats (default s3d8,int8,bf16; the toy is S3D8 only)")
    gen.add_argument("--impls", help="comma-separated generation loops for S3D8 rows (default lean,hf)")
    gen.add_argument("--prompt-tokens", type=int, help="prompt length (default 128)")
    gen.add_argument("--new-tokens", type=int, help="tokens generated (default 64)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    wrong = [f"--{name.replace('_', '-')}" for name in (KERNEL_ONLY if args.generate else GENERATE_ONLY)
             if getattr(args, name) not in (None, False)]
    if wrong:
        parser.error(f"{', '.join(wrong)} {'does not apply with' if args.generate else 'needs'} --generate")
    if args.generate:
        with stage_errors("arm-bench"):
            args.models = args.models or "toy,synthetic-1b"
            out = Path(args.out or "reports/bench_generate_records.json")
            if out.suffix != ".json":
                out = out / "bench_generate_records.json"
            began = time.perf_counter()
            write_json(out, {"records": generate_records(args)})
            run_log("arm-bench-generate", seconds=round(time.perf_counter() - began, 1))
        return
    args.out = args.out or "reports/bench.json"
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
        write_reports(out, records, machine, p)
        run_log("arm-bench", seconds=round(time.perf_counter() - began, 1))

