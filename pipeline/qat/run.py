"""Stage qat-train's run (``stages/qat_train.py``): the training set (the teacher's answers but the held-out ones,
and with ``qat.corpus_windows`` windows of the prose corpus' calibration half), the start (``qat.init: ptq``: stage
direct-cast's cast), the fingerprint a checkpoint resumes under, then :func:`pipeline.qat.train.train`."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from pipeline import cpu_numerics, params
from pipeline.teacher.answers import load_examples, split_heldout, text_examples
from pipeline.cast.calibrate import CALIBRATION, Calibration
from pipeline.texts import source_hash, source_text, text_windows
from pipeline.chat import is_text_only, tokenizer_of
from pipeline.cast.direct import INDEX, DirectCast
from pipeline.cast.fit import check_states
from pipeline.formats import FormatBase
from pipeline.files.atomic import write_json
from pipeline.models import load_config, load_processor, token_ids
from pipeline.formats.precision import Precision
from pipeline.cast.ptq import PackParams
from pipeline.qat.train import QATParams, train
from pipeline.files.shards import file_hash, fingerprint, shard_paths
from pipeline.stage import run_log, set_threads
from pipeline.teacher.source import TeacherParams, local_dir


def run(fmt: FormatBase, params_path: str, teacher_data: str) -> None:
    """Train ``fmt``'s student under the params file ``params_path``; rank 0 writes the summary."""
    p = params.load(QATParams, "qat", params_path)
    teacher = params.load(TeacherParams, "teacher", params_path)
    heldout = params.read(params_path)["heldout_prompts"]
    set_threads(p.threads)
    state_file = Path(f"data/centroids/{fmt.name}.safetensors")
    states = check_states(fmt, fmt.load_states(state_file), state_file)
    vocab = token_ids(load_config(teacher.dir))
    train_set, _ = split_heldout(load_examples(teacher_data, vocab), heldout)
    corpus = corpus_examples(p, teacher.dir, len(train_set) + heldout)
    train_set += corpus
    # qat.init ptq starts from stage direct-cast's cast by pack.algorithm; the table refit weighs input channels
    # by the calibration's diagonal when there is one
    pack = params.load(PackParams, "pack", params_path)
    algorithm, plan = pack.algorithm, Precision(fmt, pack.precision)
    cast = DirectCast(f"models/direct-cast/{fmt.name}", fmt, algorithm) if p.init == "ptq" else None
    calibration = Calibration(CALIBRATION if p.refit_table and Path(CALIBRATION).exists() else None)

    def importance(name):
        h = calibration.get(name)
        return None if h is None else h.diagonal().contiguous()

    # the thread count and the CPU code path stay in: they set the reduction order, so a checkpoint resumes on them
    fp = fingerprint(asdict(p) | {"checkpoint_every": None}, cpu_numerics.pinned(), fmt.name, plan.rules or None, file_hash(state_file),
                     [file_hash(s) for s in shard_paths(teacher_data)], heldout,
                     file_hash(local_dir(teacher.dir) / "config.json"),
                     file_hash(cast.path / INDEX) if cast is not None else None,
                     [source_hash(s) for s in p.corpus_source.split("+")] if corpus else None)
    began = time.perf_counter()
    summary = train(fmt, states, teacher.dir, teacher.dtype, train_set, p,
                    out_dir=f"models/qat/{fmt.name}", checkpoint=f"checkpoints/qat/{fmt.name}.safetensors",
                    live_dir=f"reports/qat/{fmt.name}", fingerprint=fp, start=cast.start if cast else None,
                    importance=importance, plan=plan, timings=(timings := {}))
    if summary:
        write_json(f"reports/qat/{fmt.name}/summary.json", summary)
        run_log(f"qat-train-{fmt.name}", seconds=round(time.perf_counter() - began, 1), steps=p.steps,
                checkpoint_every=p.checkpoint_every, **timings)


def corpus_examples(p: QATParams, teacher_dir: str, first_index: int) -> list:
    """``qat.corpus_windows`` windows of each text of ``qat.corpus_source`` (one after another), for a text-only
    teacher."""
    if not p.corpus_windows:
        return []
    processor = load_processor(teacher_dir)
    if not is_text_only(processor):
        raise ValueError(f"parameter qat.corpus_windows={p.corpus_windows}: needs a text-only teacher (every "
                         f"sequence of an image-text teacher's batch carries an image); set it to 0")
    windows = []
    for source in p.corpus_source.split("+"):
        text, what = source_text(source, "qat.corpus_source")
        got = text_windows(text, tokenizer_of(processor), p.corpus_windows, p.max_seq_len, "qat.corpus_windows")
        if len(got) < p.corpus_windows:
            what = "the corpus' calibration half" if source == "corpus" else what
            raise ValueError(f"parameter qat.corpus_windows={p.corpus_windows}: {what} holds "
                             f"{len(got)} windows of {p.max_seq_len} tokens")
        windows += got
    return text_examples(windows, first_index)

