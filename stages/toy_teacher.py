"""DVC stage ``toy-teacher``: build the toy processor, train the tiny Mllama teacher, save it to
``data/toy-teacher/`` (bf16 safetensors, config, generation config, processor files).

    .venv/bin/python stages/toy_teacher.py            # parameters: params.yaml, section toy_teacher

Deterministic for ``toy_teacher.seed`` on the same software: the output folder is replaced atomically (built
beside it, then renamed), and the loss curve goes to ``reports/toy_teacher/loss.csv``.
"""

from __future__ import annotations

import csv
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

from pipeline import params  # noqa: E402
from pipeline.io import atomic_open, write_json  # noqa: E402
from pipeline.toy import tasks  # noqa: E402
from pipeline.toy.model import ModelSize, build_model, count_parameters, tiny_config  # noqa: E402
from pipeline.toy.processor import build_processor, text_vocab_size  # noqa: E402
from pipeline.toy.train import TrainSettings, train  # noqa: E402


@dataclass
class EvalSettings:
    """``toy_teacher.eval``: the evaluation of the committed teacher (stage ``toy-teacher-eval``)."""

    n: int = 1024  # held-out items per task
    seed: int = 0
    batch_size: int = 64


@dataclass
class ToyTeacherParams:
    seed: int = 0
    out: str = "data/toy-teacher"
    reports: str = "reports/toy_teacher"
    threads: int = 1
    vocab_size: int = 2048  # BPE target; the toy corpus saturates below it
    corpus_items: int = 2000  # training items per task whose text trains the tokenizer
    position_std: float = 0.5
    model: ModelSize = field(default_factory=ModelSize)
    train: TrainSettings = field(default_factory=TrainSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    # sampling defaults saved in generation_config.json: what a plain generate() does (SPEC section 5)
    temperature: float = 0.6
    top_p: float = 0.9
    max_new_tokens: int = 128


def save_atomically(model, processor, generation_config: GenerationConfig, out: Path) -> None:
    """Write the model folder beside ``out``, then swap it in: a crash never leaves a half-written teacher."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.generation_config = generation_config
        model.to(torch.bfloat16).save_pretrained(tmp)
        processor.save_pretrained(tmp)
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old.{os.getpid()}")
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def main() -> None:
    p = params.load(ToyTeacherParams, "toy_teacher")
    torch.set_num_threads(p.threads)
    console = Console(stderr=True)
    t0 = time.perf_counter()
    processor = build_processor(tasks.text_corpus(p.corpus_items, p.seed), vocab_size=p.vocab_size)
    config = tiny_config(p.model, text_vocab_size(processor))
    model = build_model(config, p.seed, position_std=p.position_std)
    console.print(f"toy teacher: {count_parameters(model):,} parameters, vocabulary {len(processor.tokenizer)}, "
                  f"{p.train.steps} steps of batch {p.train.batch_size}, seed {p.seed}")

    reports = Path(p.reports)
    rows: list[dict] = []
    columns = TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn()
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("training", total=p.train.steps)

        def on_step(row: dict) -> None:
            rows.append(row)
            scores = "".join(f" {k.split('/')[1]}={v:.2f}" for k, v in row.items() if k.startswith("heldout/"))
            progress.update(bar, advance=1, description=f"training loss {row['loss']:.3f}{scores}")
            if scores:
                console.print(f"step {row['step']}: held-out{scores}")

        train(model, processor, p.train, p.seed, on_step=on_step)

    train_seconds = time.perf_counter() - t0
    generation_config = GenerationConfig(
        do_sample=True, temperature=p.temperature, top_p=p.top_p, max_new_tokens=p.max_new_tokens,
        bos_token_id=config.text_config.bos_token_id, eos_token_id=config.text_config.eos_token_id,
        pad_token_id=config.text_config.pad_token_id,
    )
    save_atomically(model, processor, generation_config, Path(p.out))

    fields = sorted({k for r in rows for k in r}, key=lambda k: (not k.startswith("step"), k.startswith("heldout"), k))
    with atomic_open(reports / "loss.csv", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    write_json(reports / "train.json", {
        "seed": p.seed,
        "parameters": count_parameters(model),
        "vocabulary": len(processor.tokenizer),
        "steps": p.train.steps,
        "batch_size": p.train.batch_size,
        "train_seconds": round(train_seconds, 1),
        "threads": p.threads,
        "final_heldout": {k: v for k, v in rows[-1].items() if k.startswith("heldout/")} if rows else {},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0]},
        "params": asdict(p),
    })
    console.print(f"saved {p.out} after {train_seconds / 60:.1f} min")


if __name__ == "__main__":
    main()
