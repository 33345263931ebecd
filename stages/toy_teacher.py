"""DVC stage ``toy-teacher``: build the toy processor, train the tiny Mllama teacher, save it to
``data/toy-teacher/`` (bf16 safetensors, config, generation config, processor files).

    .venv/bin/python stages/toy_teacher.py            # parameters: params.yaml, section toy_teacher

Deterministic for ``toy_teacher.seed`` on the same software: the output folder is replaced atomically (built
beside it, then renamed), and the loss curve goes to ``reports/toy_teacher/loss.csv``.
"""

from __future__ import annotations

import argparse
import csv
import time
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import GenerationConfig

from pipeline import params
from pipeline.io import atomic_dir, atomic_open, write_json
from pipeline.stage import console, progress, run_log, set_threads, stage_errors, versions
from pipeline.toy import tasks
from pipeline.toy.model import build_model, count_parameters, tiny_config
from pipeline.toy.processor import build_processor, text_vocab_size
from pipeline.toy.settings import ToyTeacherParams
from pipeline.toy.train import train


REPORTS = Path("reports/toy_teacher")


def save_teacher(model, processor, generation_config: GenerationConfig, out: Path) -> None:
    """Write the model folder beside ``out``, then swap it in: a crash never leaves a half-written teacher."""
    with atomic_dir(out) as tmp:
        model.generation_config = generation_config
        model.to(torch.bfloat16).save_pretrained(tmp)
        processor.save_pretrained(tmp)
        for f in tmp.iterdir():
            f.chmod(0o644)                     # the teacher is committed and shared


def inside_project(path: str) -> Path:
    """``toy_teacher.out`` is replaced whole: it must lie inside the project directory."""
    out = Path(path).resolve()
    if out == Path.cwd().resolve() or Path.cwd().resolve() not in out.parents:
        raise ValueError(f"parameter toy_teacher.out={path!r}: must be a directory inside the project "
                         f"({Path.cwd()}), since it is replaced whole")
    return Path(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    with stage_errors("toy-teacher"):
        run(params.load(ToyTeacherParams, "toy_teacher", args.params))


def run(p: ToyTeacherParams) -> None:
    out = inside_project(p.out)
    set_threads(p.threads)
    t0 = time.perf_counter()
    processor = build_processor(tasks.text_corpus(p.corpus_items, p.seed), vocab_size=p.vocab_size)
    config = tiny_config(p.model, text_vocab_size(processor))
    model = build_model(config, p.seed, position_std=p.position_std)
    console.print(f"toy teacher: {count_parameters(model):,} parameters, vocabulary {len(processor.tokenizer)}, "
                  f"{p.train.steps} steps of batch {p.train.batch_size}, seed {p.seed}")

    reports = REPORTS
    rows: list[dict] = []
    with progress() as bars:
        bar = bars.add_task("training", total=p.train.steps)

        def on_step(row: dict) -> None:
            rows.append(row)
            scores = "".join(f" {k.split('/')[1]}={v:.2f}" for k, v in row.items() if k.startswith("heldout/"))
            bars.update(bar, advance=1, description=f"training, loss {row['loss']:.3f}")
            if scores:
                console.print(f"step {row['step']}: held-out{scores}")

        train(model, processor, p.train, p.seed, on_step=on_step)

    train_seconds = time.perf_counter() - t0
    generation_config = GenerationConfig(
        do_sample=True, temperature=p.temperature, top_p=p.top_p, max_new_tokens=p.max_new_tokens,
        bos_token_id=config.text_config.bos_token_id, eos_token_id=config.text_config.eos_token_id,
        pad_token_id=config.text_config.pad_token_id,
    )
    save_teacher(model, processor, generation_config, out)

    fields = sorted({k for r in rows for k in r}, key=lambda k: (not k.startswith("step"), k.startswith("heldout"), k))
    with atomic_open(reports / "loss.csv", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    write_json(reports / "train.json", {
        "parameters": count_parameters(model),
        "vocabulary": len(processor.tokenizer),
        "final_heldout": {k: v for k, v in rows[-1].items() if k.startswith("heldout/")} if rows else {},
    })
    write_json(reports / "provenance.json", {"params": asdict(p), "versions": versions()})
    run_log("toy-teacher", train_seconds=round(train_seconds, 1), threads=p.threads)
    console.print(f"saved {p.out} after {train_seconds / 60:.1f} min")


if __name__ == "__main__":
    main()
