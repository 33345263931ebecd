"""Building and training the toy teacher from its parameters (stage ``toy-teacher``): the processor trained on the
toy corpus, the tiny Mllama, the training run, and the saved model directory."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig

from pipeline.files.atomic import atomic_dir
from pipeline.stage import console, progress
from pipeline.toy import tasks
from pipeline.toy.model import build_model, count_parameters, tiny_config
from pipeline.toy.processor import build_processor, text_vocab_size
from pipeline.toy.settings import ToyTeacherParams
from pipeline.toy.train import train


def train_teacher(p: ToyTeacherParams) -> tuple[object, object, GenerationConfig, list[dict]]:
    """``(model, processor, generation config, per-step rows)``: deterministic for ``p.seed`` on one set-up."""
    processor = build_processor(tasks.text_corpus(p.corpus_items, p.seed), vocab_size=p.vocab_size)
    config = tiny_config(p.model, text_vocab_size(processor))
    model = build_model(config, p.seed, position_std=p.position_std)
    console.print(f"toy teacher: {count_parameters(model):,} parameters, vocabulary {len(processor.tokenizer)}, "
                  f"{p.train.steps} steps of batch {p.train.batch_size}, seed {p.seed}")
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
    generation_config = GenerationConfig(
        do_sample=True, temperature=p.temperature, top_p=p.top_p, max_new_tokens=p.max_new_tokens,
        bos_token_id=config.text_config.bos_token_id, eos_token_id=config.text_config.eos_token_id,
        pad_token_id=config.text_config.pad_token_id,
    )
    return model, processor, generation_config, rows


def save_teacher(model, processor, generation_config: GenerationConfig, out: Path) -> None:
    """Write the model folder beside ``out``, then swap it in: a crash never leaves a half-written teacher."""
    with atomic_dir(out) as tmp:
        model.generation_config = generation_config
        model.to(torch.bfloat16).save_pretrained(tmp)
        processor.save_pretrained(tmp)
        for f in tmp.iterdir():
            f.chmod(0o644)                     # the teacher is committed and shared


