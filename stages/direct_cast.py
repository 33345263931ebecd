"""DVC stage direct-cast: cast the teacher to one format by ``pack.algorithm``, once, for qat-train and pack-safetensors.

    python -m pipeline.launch stages/direct_cast.py --format s3d8    # launch.num_processes processes share it

Starts from fit-centroids' fitted state of each weight (``data/centroids/<format>.safetensors``); ``gptq`` reads
the calibrate stage's ``X^T X``, or with ``calibrate.sequential`` runs the teacher over the calibration text itself and
casts the layers in order (``pipeline.cast.sequential``). Writes ``models/direct-cast/<format>/``
(``pipeline/cast/direct.py``): the packed tensors pack-safetensors writes and the float32 start of QAT, one file per
decoder layer, the layers dealt to the processes, each on its GPU where it has one (else the CPU; the index records
which: GPU arithmetic can round a few codes differently). A killed run resumes from the layers it finished (``checkpoints/direct-cast/<format>/``).
"""

from __future__ import annotations

import argparse

import pipeline.cpu_numerics  # noqa: F401  (first: one CPU code path, the same bytes on any x86-64)
from pipeline import formats, params
from pipeline.cast.run import run
from pipeline.launch.processes import run_stage
from pipeline.stage import stage_errors


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", required=True, help=f"one of {', '.join(formats.QUANTISED)}")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--teacher-data", default="data/teacher", help="the teacher's answers (calibrate.source "
                        "teacher-answers, calibrate.sequential)")
    args = parser.parse_args(argv)
    with stage_errors("direct-cast"):
        run(formats.comparison(args.format, "--format"), params.read(args.params), args.teacher_data)


if __name__ == "__main__":
    run_stage(main)
