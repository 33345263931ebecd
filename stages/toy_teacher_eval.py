"""DVC stage ``toy-teacher-eval``: score the committed toy teacher on held-out items of the four toy tasks,
with the real images and with blank ones (the blind baseline: what the text alone gives away).

    .venv/bin/python stages/toy_teacher_eval.py       # parameters: params.yaml, toy_teacher.eval

It also answers held-out generic requests of the prompt pool's styles ("toy-describe": describe, summarise;
in a few words, in capitals, JSON ...), the kind of prompt teacher-generate gives it: the share answered
exactly as the toy world's reference answer, overall and for the requests that ask for capitals.

Writes ``reports/teacher_eval.json``, ``reports/teacher_eval.md`` and the per-example answers,
``reports/teacher_eval_examples.parquet`` (column ``condition``: image | blank).
"""

from __future__ import annotations

import argparse

import pipeline.cpu_numerics  # noqa: F401  (first: one CPU code path, the same bytes on any x86-64)
import pyarrow.parquet as pq

from pipeline import params
from pipeline.files.atomic import atomic_path, write_json, write_text
from pipeline.stage import console, run_log, set_threads, stage_errors
from pipeline.toy.evaluate import MIN_AVG, MIN_TASK, evaluate_teacher
from pipeline.toy.settings import ToyTeacherParams


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    with stage_errors("toy-teacher-eval"):
        p = params.load(ToyTeacherParams, "toy_teacher", args.params)
        set_threads(p.threads)
        summary, report, examples, seconds = evaluate_teacher(p)
        write_json("reports/teacher_eval.json", summary)
        write_text("reports/teacher_eval.md", report)
        with atomic_path("reports/teacher_eval_examples.parquet") as tmp:
            pq.write_table(examples, tmp)
        run_log("toy-teacher-eval", seconds=round(seconds, 1))
        if not summary["bar_met"]:
            console.print(f"[bold yellow]toy-teacher-eval: the teacher misses the quality bar ({MIN_TASK} per task, "
                          f"{MIN_AVG} average)")


if __name__ == "__main__":
    main()
