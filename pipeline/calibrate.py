"""Calibration for the post-training methods: ``H = X^T X / n_tokens`` of the teacher's inputs to every Linear
the recipe quantises, over a seeded sample of the training prompts' teacher answers (never the held-out ones).

GPTQ (``pack.method: gptq``) needs the whole matrix; the scale search's importance is its diagonal. Each prompt
runs on its own (batch of one), so no padding token counts; image tiles the picture does not use are part of
the vision encoder's input and count as they do in every forward. Rows are accumulated in float64.

At the 11B the matrices take ``sum(d_in^2) * 4`` bytes (the 40 MLP down projections alone, 14,336^2 each:
33 GB), twice that while summed in float64. So the prompts run once per group of matrices whose float64 sums fit
``calibrate.hessian_memory_gb`` (consecutive in the file's sorted order), each group's matrices written as soon as
it is done: the file is streamed tensor by tensor, and readers hold one at a time. The teacher and the sums live on
the GPU when there is one; host memory is then the teacher while it loads plus one matrix in float32 at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import safe_open

from pipeline import ptq
from pipeline.models import dtype_of, load_model, load_processor, quantised_weight_names, token_ids
from pipeline.params import non_negative, positive
from pipeline.safetensors_io import StreamingWriter
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
    n_prompts: int = positive()            # teacher answers from the training split (all of them when fewer)
    max_seq_len: int = positive()          # longer prompt + answer sequences are cut here
    seed: int
    threads: int = non_negative()          # torch intra-op threads (0: torch's default)
    hessian_memory_gb: float = positive()  # float64 sums held at once; beyond, more passes over the prompts


def calibrate(p: CalibrateParams, teacher: TeacherParams, teacher_data: str, heldout: int, out: str,
              metadata: dict[str, str], pool: str | None = None, on_prompt=None) -> dict:
    """Write ``{checkpoint weight name P (of P.weight): H float32 [d_in, d_in]}`` for every quantised Linear of the
    teacher to the safetensors file ``out`` (with ``metadata`` and the summary in its metadata); return the
    summary (prompts, modules, tokens, passes)."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model = load_model(teacher.dir, dtype_of(teacher.dtype)).to(device)
    processor = load_processor(teacher.dir)
    train, _ = split_heldout(load_examples(teacher_data, token_ids(model.config)), heldout)
    if not train:
        raise ValueError(f"{teacher_data}: no training prompts to calibrate on (heldout_prompts={heldout})")
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(p.seed)).tolist()
    chosen = [train[i] for i in sorted(order[:p.n_prompts])]
    names = {m: saved.removesuffix(".weight") for m, saved in quantised_weight_names(model).items()
             if isinstance(model.get_submodule(m), torch.nn.Linear)}
    modules = sorted(names, key=names.get)                      # the file's order
    width = {m: model.get_submodule(m).in_features for m in modules}
    groups = passes([width[m] for m in modules], p.hessian_memory_gb * 1e9)
    tokens = sum(min(len(e.prompt_ids) + len(e.response_ids), p.max_seq_len) for e in chosen)
    summary = {"prompts": len(chosen), "modules": len(modules), "tokens": tokens}
    specs = [(names[m], torch.float32, (width[m], width[m])) for m in modules]
    with StreamingWriter(out, specs, {**metadata, **{k: str(v) for k, v in summary.items()}}) as writer:
        for a, b in groups:
            group = modules[a:b]
            batches = (_inputs(collate([e], processor, p.max_seq_len, pool), model.dtype, device, on_prompt)
                       for e in chosen)
            found = ptq.collect_hessians(model, batches, group)
            never = [m for m in group if m not in found]
            if never:
                raise ValueError(f"calibration: modules never called on {len(chosen)} prompts, e.g. {never[:3]} "
                                 f"(do the prompts hold an image?)")
            for m in group:
                h = found.pop(m).cpu()
                if not bool(torch.isfinite(h).all()):
                    raise ValueError(f"calibration: the teacher's inputs to {m} hold NaN or Inf")
                writer.write(names[m], h)
    return {**summary, "passes": len(groups)}


def passes(widths: list[int], budget_bytes: float) -> list[tuple[int, int]]:
    """``[(start, stop)]``: consecutive runs of matrices whose float64 ``d_in x d_in`` sums fit ``budget_bytes``
    together (a matrix larger than the budget alone)."""
    groups, start, held = [], 0, 0
    for i, d in enumerate(widths):
        size = 8 * d * d
        if i > start and held + size > budget_bytes:
            groups.append((start, i))
            start, held = i, 0
        held += size
    if widths:
        groups.append((start, len(widths)))
    return groups


def _inputs(batch: dict, dtype: torch.dtype, device, on_prompt) -> dict:
    batch = model_inputs(batch, dtype, device)
    if on_prompt is not None:
        on_prompt()
    return batch
