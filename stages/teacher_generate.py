"""DVC stage teacher-generate: the bf16 teacher answers every sampled prompt (temperature 0.6, top-p 0.9).

    python -m pipeline.launch stages/teacher_generate.py    # launch.num_processes from params.yaml

One output shard per input shard in ``data/teacher/``. Finished shards are kept in
``checkpoints/teacher-generate/`` with a fingerprint of their input, the parameters and the teacher, so a
killed run resumes where it stopped and ends with the same bytes (``pipeline.teacher.generate_answers``). Diversity
metrics go to ``reports/teacher_generate.json``.
"""

from __future__ import annotations

import argparse
import json
import time

import pipeline.cpu_numerics  # noqa: F401  (first: one CPU code path, the same bytes on any x86-64)
import pipeline.toy  # noqa: F401  (the `toy` image pool the sampled prompts refer to)
from pipeline import params
from pipeline.teacher.generate_answers import GenerateParams, run
from pipeline.files.atomic import write_json
from pipeline.launch.processes import run_stage
from pipeline.stage import console, run_log, set_threads, stage_errors
from pipeline.teacher.source import TeacherParams


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--prompts", default="data/sampled")
    parser.add_argument("--out", default="data/teacher")
    parser.add_argument("--report", default="reports/teacher_generate.json")
    args = parser.parse_args(argv)
    with stage_errors("teacher-generate"):
        doc = params.read(args.params)
        p: GenerateParams = doc["generate"]
        teacher: TeacherParams = doc["teacher"]
        set_threads(p.threads)
        began = time.perf_counter()
        stats = run(p, teacher, args.prompts, args.out, pool=doc["sample"].images)
        if stats:
            write_json(args.report, stats)
            run_log("teacher-generate", seconds=round(time.perf_counter() - began, 1))
            console.print("[green]teacher-generate[/] " + json.dumps({k: round(v, 3) for k, v in stats.items()}))


if __name__ == "__main__":
    run_stage(main)
