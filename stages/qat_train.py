"""DVC stage qat-train: train one format's quantised student by distillation from the teacher.

    python stages/qat_train.py --format s3d8          # or: accelerate launch stages/qat_train.py --format s3d8

Writes the student's fp32 master weights to ``models/qat/<format>/``, per-step loss / KL / lr as DVC
plots (DVCLive) in ``reports/qat/<format>/``, and a summary. A checkpoint every ``qat.checkpoint_every``
steps lets a killed run resume where it stopped, with the same result.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from pipeline import formats, params
from pipeline.io import write_json
from pipeline.qat.data import load_examples, split_heldout
from pipeline.qat.states import load_states
from pipeline.qat.train import QATParams, train
from pipeline.shards import file_hash, fingerprint, shard_paths
from pipeline.stage import set_threads, stage_errors
from pipeline.teacher import TeacherParams, local_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", required=True, help=f"one of {', '.join(formats.QUANTISED)}")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--teacher-data", default="data/teacher")
    args = parser.parse_args(argv)
    with stage_errors("qat-train"):
        if args.format not in formats.QUANTISED:
            raise ValueError(f"--format {args.format!r}: expected one of {', '.join(formats.QUANTISED)}")
        p = params.load(QATParams, "qat", args.params)
        teacher = params.load(TeacherParams, "teacher", args.params)
        heldout = params.load_yaml(args.params).get("heldout_prompts", 0)
        set_threads(p.threads)
        state_file = Path(f"data/centroids/{args.format}.safetensors")
        states = load_states(state_file, args.format)
        train_set, _ = split_heldout(load_examples(args.teacher_data), int(heldout))
        fp = fingerprint(asdict(p) | {"threads": None, "checkpoint_every": None}, args.format, file_hash(state_file),
                         [file_hash(s) for s in shard_paths(args.teacher_data)], heldout,
                         file_hash(local_dir(teacher.source) / "config.json"))
        summary = train(args.format, states, teacher.source, teacher.dtype, train_set, p,
                        out_dir=f"models/qat/{args.format}", checkpoint=f"checkpoints/qat/{args.format}.pt",
                        live_dir=f"reports/qat/{args.format}", fingerprint=fp)
        if summary:
            write_json(f"reports/qat/{args.format}/summary.json", summary)


if __name__ == "__main__":
    main()
