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
import time
from dataclasses import asdict
from pathlib import Path

import pipeline.cpu_numerics  # noqa: F401  (first: one CPU code path, the same bytes on any x86-64)
import pipeline.toy  # noqa: F401  (the `toy` image pool the teacher's answers refer to)
from pipeline import formats, params
from pipeline.calibrate import CALIBRATION, Calibration
from pipeline.direct_cast import INDEX, DirectCast
from pipeline.fit import check_states
from pipeline.io import write_json
from pipeline.processes import run_stage
from pipeline.models import load_config, load_processor, token_ids
from pipeline.precision import Precision
from pipeline.ptq import PackParams
from pipeline.chat import is_text_only, tokenizer_of
from pipeline.eval.text import corpus_info, corpus_text, text_windows
from pipeline.answers import load_examples, split_heldout, text_examples
from pipeline.qat.train import QATParams, train
from pipeline.shards import file_hash, fingerprint, shard_paths
from pipeline.stage import run_log, set_threads, stage_errors
from pipeline.teacher_source import TeacherParams, local_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", required=True, help=f"one of {', '.join(formats.QUANTISED)}")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--teacher-data", default="data/teacher")
    args = parser.parse_args(argv)
    with stage_errors("qat-train"):
        fmt = formats.comparison(args.format, "--format")
        p = params.load(QATParams, "qat", args.params)
        teacher = params.load(TeacherParams, "teacher", args.params)
        heldout = params.read(args.params)["heldout_prompts"]
        set_threads(p.threads)
        state_file = Path(f"data/centroids/{fmt.name}.safetensors")
        states = check_states(fmt, fmt.load_states(state_file), state_file)
        vocab = token_ids(load_config(teacher.dir))
        train_set, _ = split_heldout(load_examples(args.teacher_data, vocab), heldout)
        corpus = corpus_examples(p, teacher.dir, len(train_set) + heldout)
        train_set += corpus
        # qat.init ptq starts from stage direct-cast's cast by pack.method; the table refit weighs input channels
        # by the calibration's diagonal when there is one
        pack = params.load(PackParams, "pack", args.params)
        method, plan = pack.method, Precision(fmt, pack.precision)
        cast = DirectCast(f"models/direct-cast/{fmt.name}", fmt, method) if p.init == "ptq" else None
        calibration = Calibration(CALIBRATION if p.refit_table and Path(CALIBRATION).exists() else None)

        def importance(name):
            h = calibration.get(name)
            return None if h is None else h.diagonal().contiguous()

        # the thread count stays in: it sets the reduction order, so a checkpoint resumes on the count it was made on
        fp = fingerprint(asdict(p) | {"checkpoint_every": None}, fmt.name, plan.rules or None, file_hash(state_file),
                         [file_hash(s) for s in shard_paths(args.teacher_data)], heldout,
                         file_hash(local_dir(teacher.dir) / "config.json"),
                         file_hash(cast.path / INDEX) if cast is not None else None,
                         corpus_info("rest")["sha256"] if corpus else None)
        began = time.perf_counter()
        summary = train(fmt, states, teacher.dir, teacher.dtype, train_set, p,
                        out_dir=f"models/qat/{fmt.name}", checkpoint=f"checkpoints/qat/{fmt.name}.safetensors",
                        live_dir=f"reports/qat/{fmt.name}", fingerprint=fp, start=cast.start if cast else None,
                        importance=importance, plan=plan)
        if summary:
            write_json(f"reports/qat/{fmt.name}/summary.json", summary)
            run_log(f"qat-train-{fmt.name}", seconds=round(time.perf_counter() - began, 1), steps=p.steps)


def corpus_examples(p: QATParams, teacher_dir: str, first_index: int) -> list:
    """``qat.corpus_windows`` windows of the prose corpus' calibration half, for a text-only teacher."""
    if not p.corpus_windows:
        return []
    processor = load_processor(teacher_dir)
    if not is_text_only(processor):
        raise ValueError(f"parameter qat.corpus_windows={p.corpus_windows}: needs a text-only teacher (every "
                         f"sequence of an image-text teacher's batch carries an image); set it to 0")
    windows = text_windows(corpus_text("rest"), tokenizer_of(processor), p.corpus_windows, p.max_seq_len,
                           "qat.corpus_windows")
    if len(windows) < p.corpus_windows:
        raise ValueError(f"parameter qat.corpus_windows={p.corpus_windows}: the corpus' calibration half holds "
                         f"{len(windows)} windows of {p.max_seq_len} tokens")
    return text_examples(windows, first_index)


if __name__ == "__main__":
    run_stage(main)
