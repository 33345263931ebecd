"""The ``toy_teacher`` section of ``params.yaml``: training (stage ``toy-teacher``) and evaluation (stage
``toy-teacher-eval``) of the toy teacher."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.toy.model import ModelSize
from pipeline.toy.train import TrainSettings


@dataclass
class EvalSettings:
    """``toy_teacher.eval``: the evaluation of the committed teacher (stage ``toy-teacher-eval``)."""

    n: int          # held-out items per task
    seed: int
    batch_size: int
    generic_n: int  # held-out generic requests (toy-describe): does it answer the prompt sampler's styles?


@dataclass
class ToyTeacherParams:
    seed: int
    out: str
    threads: int
    vocab_size: int    # BPE target; the toy corpus saturates below it
    corpus_items: int  # training items per task whose text trains the tokenizer
    position_std: float
    model: ModelSize
    train: TrainSettings
    eval: EvalSettings
    # sampling defaults saved in generation_config.json: what a plain generate() does (SPEC section 5)
    temperature: float
    top_p: float
    max_new_tokens: int
