"""DVC stage calibrate: ``X^T X`` of the teacher's inputs to every quantised Linear, for the post-training
methods of pack-safetensors (GPTQ; ``pipeline/cast/calibrate.py``).

    python stages/calibrate.py

Writes ``data/calibration/hessians.safetensors`` (one float32 ``[d_in, d_in]`` per weight, named as the
checkpoint's ``P`` of ``P.weight``; prompts, tokens, seed and versions in the metadata).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

import pipeline.cpu_numerics  # noqa: F401  (first: one CPU code path, the same bytes on any x86-64)
import pipeline.toy  # noqa: F401  (the `toy` image pool the teacher's answers refer to)
from pipeline import params
from pipeline.cast.calibrate import CalibrateParams, calibrate
from pipeline.stage import console, progress, run_log, set_threads, stage_errors, versions

OUT = "data/calibration/hessians.safetensors"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--teacher-data", default="data/teacher")
    args = parser.parse_args(argv)
    with stage_errors("calibrate"):
        doc = params.read(args.params)
        p: CalibrateParams = doc["calibrate"]
        set_threads(p.threads)
        began = time.perf_counter()
        with progress() as bar:
            task = bar.add_task("calibrate", total=None)
            summary = calibrate(p, doc["teacher"], args.teacher_data, doc["heldout_prompts"], OUT,
                                {"params": json.dumps({k: v for k, v in asdict(p).items()
                                                       if k != "hessian_memory_gb"}, sort_keys=True),
                                 **versions()},
                                pool=doc["sample"].images, on_prompt=lambda: bar.advance(task))
        run_log("calibrate", seconds=round(time.perf_counter() - began, 2), passes=summary["passes"])
        console.print(f"[green]calibrate[/] {summary['modules']} Linear inputs over {summary['prompts']} prompts "
                      f"({summary['tokens']} tokens, {summary['passes']} pass(es)) -> {OUT}")


if __name__ == "__main__":
    main()
