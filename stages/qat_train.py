"""DVC stage qat-train: train one format's quantised student by distillation from the teacher.

    python -m pipeline.launch stages/qat_train.py --format s3d8    # launch.num_processes from params.yaml

Trains on the teacher's answers (the held-out ones never) and, with ``qat.corpus_windows``, windows of the
prose corpus' calibration half. Writes the student's fp32 master weights to ``models/qat/<format>/``, per-step
loss / KL / lr as DVC plots (DVCLive) in ``reports/qat/<format>/``, and a summary. A checkpoint every ``qat.checkpoint_every``
steps (``checkpoints/qat/<format>.safetensors``) lets a killed run resume where it stopped, with the same
result.
"""

from __future__ import annotations

import argparse

import pipeline.cpu_numerics  # noqa: F401  (first: one CPU code path, the same bytes on any x86-64)
import pipeline.toy  # noqa: F401  (the `toy` image pool the teacher's answers refer to)
from pipeline import formats
from pipeline.launch.processes import run_stage
from pipeline.qat.run import run
from pipeline.stage import stage_errors


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", required=True, help=f"one of {', '.join(formats.QUANTISED)}")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--teacher-data", default="data/teacher")
    args = parser.parse_args(argv)
    with stage_errors("qat-train"):
        run(formats.comparison(args.format, "--format"), args.params, args.teacher_data)


if __name__ == "__main__":
    run_stage(main)
