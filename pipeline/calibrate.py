"""Calibration for the post-training methods: ``H = X^T X / n_tokens`` of the teacher's inputs to every Linear
the recipe quantises, over a seeded sample of the training prompts' teacher answers (never the held-out ones).

GPTQ (``pack.method: gptq``) needs the whole matrix; the scale search's importance is its diagonal. Each prompt
runs on its own (batch of one), so no padding token counts; image tiles the picture does not use are part of
the vision encoder's input and count as they do in every forward. Rows are accumulated in float64.

At the 11B the matrices take ``sum(d_in^2) * 4`` bytes (the 40 MLP down projections alone, 14,336^2 each:
33 GB): the file is streamed tensor by tensor on write and read, and pack-safetensors holds one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import safe_open

from pipeline import ptq
from pipeline.models import dtype_of, load_model, load_processor, quantised_weight_names, token_ids
from pipeline.params import non_negative, positive
from pipeline.qat.data import collate, load_examples, model_inputs, split_heldout
from pipeline.teacher import TeacherParams


CALIBRATION = "data/calibration/hessians.safetensors"
"""Where stage calibrate writes the matrices."""


class Calibration:
    """The teacher's ``X^T X`` per Linear weight (stage calibrate), read one matrix at a time; ``get`` gives None
    for a weight without one (embeddings: GPTQ falls back to the scale search) or when no file is used."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.names = set()
        if path is not None:
            with safe_open(path, "pt") as f:
                self.names = set(f.keys())

    def get(self, name: str):
        if name not in self.names:
            return None
        with safe_open(self.path, "pt") as f:
            return f.get_tensor(name)


@dataclass
class CalibrateParams:
    n_prompts: int = positive(128)      # teacher answers from the training split (all of them when fewer)
    max_seq_len: int = positive(160)    # longer prompt + answer sequences are cut here
    seed: int = 0
    threads: int = non_negative(1)      # torch intra-op threads (0: torch's default)


def hessians(p: CalibrateParams, teacher: TeacherParams, teacher_data: str, heldout: int,
             pool: str | None = None, on_prompt=None) -> tuple[dict[str, torch.Tensor], dict]:
    """``({checkpoint weight name P (of P.weight): H float32 [d_in, d_in]}, summary)`` for every quantised
    Linear of the teacher."""
    model = load_model(teacher.dir, dtype_of(teacher.dtype))
    processor = load_processor(teacher.dir)
    train, _ = split_heldout(load_examples(teacher_data, token_ids(model.config)), heldout)
    if not train:
        raise ValueError(f"{teacher_data}: no training prompts to calibrate on (heldout_prompts={heldout})")
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(p.seed)).tolist()
    chosen = [train[i] for i in sorted(order[:p.n_prompts])]
    batches = (_inputs(collate([e], processor, p.max_seq_len, pool), model.dtype, on_prompt) for e in chosen)
    names = quantised_weight_names(model)
    linears = [m for m, _ in names.items() if isinstance(model.get_submodule(m), torch.nn.Linear)]
    found = ptq.collect_hessians(model, batches, linears)
    never = sorted(set(linears) - set(found))
    if never:
        raise ValueError(f"calibration: modules never called on {len(chosen)} prompts, e.g. {never[:3]} "
                         f"(do the prompts hold an image?)")
    for name, h in found.items():
        if not bool(torch.isfinite(h).all()):
            raise ValueError(f"calibration: the teacher's inputs to {name} hold NaN or Inf")
    out = {names[m].removesuffix(".weight"): h for m, h in found.items()}
    tokens = sum(min(len(e.prompt_ids) + len(e.response_ids), p.max_seq_len) for e in chosen)
    summary = {"prompts": len(chosen), "modules": len(out), "tokens": tokens}
    return out, summary


def _inputs(batch: dict, dtype: torch.dtype, on_prompt) -> dict:
    batch = model_inputs(batch, dtype)
    if on_prompt is not None:
        on_prompt()
    return batch
