"""The ``toy_teacher`` section of ``params.yaml``: training (stage ``toy-teacher``) and evaluation (stage
``toy-teacher-eval``) of the toy teacher."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.toy.model import ModelSize
from pipeline.toy.train import TrainSettings


@dataclass
class EvalSettings:
    """``toy_teacher.eval``: the evaluation of the committed teacher (stage ``toy-teacher-eval``)."""

    n: int = 1024  # held-out items per task
    seed: int = 0
    batch_size: int = 64
    generic_n: int = 512  # held-out generic requests (toy-describe): does it answer the prompt sampler's styles?


@dataclass
class ToyTeacherParams:
    seed: int = 0
    out: str = "data/toy-teacher"
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
