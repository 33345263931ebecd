"""DVC stage eval: score the bf16 teacher and every direct-cast and QAT model, loaded from packed files.

    python stages/eval.py
    python -m pipeline.launch stages/eval.py      # what dvc.yaml runs: launch.num_processes ranks share the models

A text-only teacher (Llama) is measured instead by KL, top-1 agreement and perplexity (``pipeline/eval/text.py``),
into the same files (``eval.json`` per model: format, method, bpp, size_mb, kl, top1_agreement, perplexity; a
greedy generation sample per model in ``reports/answers/``).

Writes ``reports/eval.json`` (per model: format, method, bpp, size_mb, kl, scores per task as lmms-eval scores the
generations, avg; beside them ``scores_cleaned``: per model and task, ChartQA's answer cleaned up),
``reports/eval_scores.csv`` (score per task and model, for ``dvc plots``), ``reports/summary.md`` (the
paper's table with our numbers), ``reports/eval_plot.png`` and per-example answers in
``reports/answers/<model>.parquet``.
"""

from __future__ import annotations

import argparse
import time

import pipeline.cpu_numerics  # noqa: F401  (first: one CPU code path, the same bytes on any x86-64)

import pipeline.toy  # noqa: F401  (registers the toy tasks and image pool)
from pipeline import params
from pipeline.eval.suite import EvalParams, run
from pipeline.eval.report import write_reports
from pipeline.launch.processes import run_stage
from pipeline.stage import console, run_log, set_threads, stage_errors
from pipeline.teacher.source import TeacherParams


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--teacher-data", default="data/teacher")
    args = parser.parse_args(argv)
    with stage_errors("eval"):
        doc = params.read(args.params)
        p: EvalParams = doc["eval"]
        teacher: TeacherParams = doc["teacher"]
        set_threads(p.threads)
        began = time.perf_counter()
        out = run(p, teacher, doc["formats"], doc["heldout_prompts"], args.teacher_data)
        if out is None:                                   # another rank writes the results
            return
        result, baselines, answers = out
        write_reports(result, baselines, answers, p.tasks, teacher.name)
        run_log("eval", seconds=round(time.perf_counter() - began, 1))
        console.print("[green]eval[/] wrote reports/eval.json, reports/summary.md, reports/eval_plot.png")


if __name__ == "__main__":
    run_stage(main)
