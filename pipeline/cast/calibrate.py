"""Calibration for the post-training methods: ``H = X^T X / n_tokens`` of the teacher's inputs to every Linear
the recipe quantises, over a seeded sample of the training prompts' teacher answers (never the held-out ones).

GPTQ (``pack.algorithm: gptq``) needs the whole matrix; the scale search's importance is its diagonal. Each prompt
runs on its own (batch of one), so no padding token counts; image tiles the picture does not use are part of
the vision encoder's input and count as they do in every forward. Rows are accumulated in float64.

At the 11B the matrices take ``sum(d_in^2) * 4`` bytes (the 40 MLP down projections alone, 14,336^2 each:
33 GB), twice that while summed in float64. So the prompts run once per group of matrices whose peak (:func:`peak_bytes`:
the float64 sums and one update's temporaries) fits ``calibrate.hessian_memory_gb`` (consecutive in the file's sorted
order), each group's matrices written as soon as it is done: the file is streamed tensor by tensor, and readers hold one at a time. The teacher and the sums live on
the GPU when there is one; host memory is then the teacher while it loads plus one matrix in float32 at a time.

What the teacher reads (``calibrate.source``): ``teacher-answers`` (the training prompts with the teacher's answers,
images included: the only source for a vision model's image path), ``corpus`` (the part of the project's English
prose corpus that perplexity is never measured on, :func:`pipeline.texts.corpus_text` ``"rest"``), ``english``
(the public-domain English the project ships, :mod:`pipeline.texts`: fiction, talks, an encyclopedia article),
``file:PATH`` (a UTF-8 text file of the user's), the text cut into ``n_prompts`` windows of ``max_seq_len`` tokens,
or ``self``: ``n_prompts`` sequences of ``max_seq_len`` tokens the teacher samples itself from its BOS token
(temperature 1, seeded; no data needed, but on SmolLM2 it calibrated far worse than real prose: README).
Sources joined by ``+`` (``corpus+teacher-answers``) are read one after another, ``n_prompts`` sequences each.
With ``calibrate.sequential`` the direct cast takes each matrix's ``X^T X`` from the partly cast model itself
(:mod:`pipeline.cast.sequential`, over the same :func:`calibration_inputs`); this stage's teacher matrices then serve
the QAT table refit only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from safetensors import safe_open

from pipeline.cast import ptq
from pipeline.models import dtype_of, load_model, load_processor, quantised_weight_names, token_ids
from pipeline.section import non_negative, positive
from pipeline.packed.safetensors_io import StreamingWriter
from pipeline.files.shards import file_hash, shard_paths
from pipeline.teacher.answers import collate, load_examples, model_inputs, split_heldout, tokenizer_of
from pipeline.teacher.source import TeacherParams
from pipeline.texts import source_hash, source_text, text_windows  # noqa: F401  (source_text: also imported from here)


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


TEXT_SOURCES = ("teacher-answers", "corpus", "english", "self")


def check_source(source: str) -> str:
    """The ``calibrate.source`` parameter: one of :data:`TEXT_SOURCES` or ``file:PATH``, or several joined by
    ``+``."""
    for part in source.split("+"):
        if not (part in TEXT_SOURCES or (part.startswith("file:") and len(part) > 5)):
            raise ValueError(f"calibrate.source {source!r}: {part!r} is not one of {', '.join(TEXT_SOURCES)} or "
                             f"file:PATH (several joined by '+')")
    return source


def _parts(p: "CalibrateParams") -> list["CalibrateParams"] | None:
    """A joined source's parts, each with the rest of ``p``; None for a single source."""
    return [replace(p, source=s) for s in p.source.split("+")] if "+" in p.source else None


@dataclass
class CalibrateParams:
    n_prompts: int = positive()            # teacher answers from the training split (all of them when fewer), or text
                                           # windows
    max_seq_len: int = positive()          # longer prompt + answer sequences are cut here; the text windows' length
    seed: int
    threads: int = non_negative()          # torch intra-op threads (0: torch's default)
    hessian_memory_gb: float = positive()  # the peak of a pass (float64 sums and one update's temporaries)
    source: str                            # teacher-answers | corpus | english | self | file:PATH, or several
                                           # joined by +
    sequential: bool                       # the direct cast's X^T X from the partly cast model (GPTQ's order)
    act_order: bool                        # GPTQ rounds the columns by decreasing X^T X diagonal (desc_act)

    def __post_init__(self) -> None:
        check_source(self.source)


def calibration_fingerprint(p: CalibrateParams, teacher_data: str) -> list:
    """What determines :func:`calibration_inputs`: the parameters that choose the text and the text itself."""
    if parts := _parts(p):
        return [calibration_fingerprint(q, teacher_data) for q in parts]
    chosen = {k: getattr(p, k) for k in ("n_prompts", "max_seq_len", "seed", "source")}
    if p.source == "teacher-answers":
        return [chosen, [file_hash(s) for s in shard_paths(teacher_data)]]
    if p.source == "self":
        return [chosen, SELF_TEXT]
    return [chosen, source_hash(p.source)]


SELF_TEXT = "sampled from BOS, temperature 1, one torch.Generator seeded by calibrate.seed (v1)"


def self_text(model, tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` sequences of ``length`` tokens the teacher samples from its BOS token, one seeded generator for all
    (its end-of-text token is a token like any other here: the windows keep their length)."""
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    lm = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    head = model.get_output_embeddings()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.full((n, 1), bos, dtype=torch.long)
    device = next(model.parameters()).device
    with torch.no_grad():
        out = lm(input_ids=ids.to(device), use_cache=True)
        for _ in range(length - 1):
            logits = head(out.last_hidden_state[:, -1]).float().cpu()
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
            ids = torch.cat([ids, nxt], 1)
            out = lm(input_ids=nxt.to(device), cache=out.cache, use_cache=True)
    return ids.tolist()


def calibration_inputs(p: CalibrateParams, processor, teacher_data: str, heldout: int, vocab: int,
                       pool: str | None = None, teacher=None) -> list[dict]:
    """The calibration sequences as model inputs (CPU, one sequence each, no padding), from ``p.source``
    (``self``: sampled by ``teacher``, the unquantised model); a joined source's parts one after another."""
    if parts := _parts(p):
        return [x for q in parts for x in calibration_inputs(q, processor, teacher_data, heldout, vocab, pool, teacher)]
    if p.source == "teacher-answers":
        train, _ = split_heldout(load_examples(teacher_data, vocab), heldout)
        if not train:
            raise ValueError(f"{teacher_data}: no training prompts to calibrate on (heldout_prompts={heldout})")
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(p.seed)).tolist()
        chosen = [train[i] for i in sorted(order[:p.n_prompts])]
        return [collate([e], processor, p.max_seq_len, pool) for e in chosen]
    if p.source == "self":
        if teacher is None:
            raise ValueError("calibrate.source self: the teacher must be given to sample from")
        windows = self_text(teacher, tokenizer_of(processor), p.n_prompts, p.max_seq_len, p.seed)
        return [{"input_ids": torch.tensor([w]), "attention_mask": torch.ones(1, len(w), dtype=torch.long)}
                for w in windows]
    text, what = source_text(p.source, "calibrate.source")
    windows = text_windows(text, tokenizer_of(processor), p.n_prompts, p.max_seq_len, what)
    return [{"input_ids": torch.tensor([w]), "attention_mask": torch.ones(1, len(w), dtype=torch.long)}
            for w in windows]


def calibrate(p: CalibrateParams, teacher: TeacherParams, teacher_data: str, heldout: int, out: str,
              metadata: dict[str, str], pool: str | None = None, on_prompt=None) -> dict:
    """Write ``{checkpoint weight name P (of P.weight): H float32 [d_in, d_in]}`` for every quantised Linear of the
    teacher to the safetensors file ``out`` (with ``metadata`` and the summary in its metadata); return the
    summary (prompts, modules, tokens, passes)."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model = load_model(teacher.dir, dtype_of(teacher.dtype)).to(device)
    processor = load_processor(teacher.dir)
    chosen = calibration_inputs(p, processor, teacher_data, heldout, token_ids(model.config), pool, teacher=model)
    names = {m: saved.removesuffix(".weight") for m, saved in quantised_weight_names(model).items()
             if isinstance(model.get_submodule(m), torch.nn.Linear)}
    modules = sorted(names, key=names.get)                      # the file's order
    width = {m: model.get_submodule(m).in_features for m in modules}
    rows = max((rows_per_prompt(e, model.config) for e in chosen), default=0)
    groups = passes([width[m] for m in modules], p.hessian_memory_gb * 1e9, rows)
    tokens = sum(int(e["input_ids"].numel()) for e in chosen)
    summary = {"prompts": len(chosen), "modules": len(modules), "tokens": tokens}
    specs = [(names[m], torch.float32, (width[m], width[m])) for m in modules]
    with StreamingWriter(out, specs, {**metadata, **{k: str(v) for k, v in summary.items()}}) as writer:
        for a, b in groups:
            group = modules[a:b]
            batches = (_inputs(e, model.dtype, device, on_prompt) for e in chosen)
            found = ptq.collect_hessians(model, batches, group)
            never = [m for m in group if m not in found]
            if never:
                raise ValueError(f"calibration: modules never called on {len(chosen)} prompts, e.g. {never[:3]} "
                                 f"(do the prompts hold an image? calibrate.source={p.source})")
            for m in group:
                h = found.pop(m).cpu()
                if not bool(torch.isfinite(h).all()):
                    raise ValueError(f"calibration: the teacher's inputs to {m} hold NaN or Inf")
                writer.write(names[m], h)
    return {**summary, "passes": len(groups)}


def peak_bytes(widths: list[int], rows: int) -> int:
    """The most memory :func:`pipeline.cast.ptq.input_sums` holds for matrices of these input widths: their float64
    sums, and while one is updated its ``d x d`` float64 product, its input ``rows`` (the most one prompt feeds a Linear:
    its tokens, or its image's tiles x patches; float32 at most) and their float64 copy. Each float64 sum is freed
    as its float32 mean is made, so the means never add to it."""
    return 8 * sum(d * d for d in widths) + max((8 * d * d + 12 * rows * d for d in widths), default=0)


def passes(widths: list[int], budget_bytes: float, rows: int = 0) -> list[tuple[int, int]]:
    """``[(start, stop)]``: consecutive runs of matrices whose :func:`peak_bytes` fits ``budget_bytes`` (a matrix
    larger than the budget alone)."""
    groups, start = [], 0
    for i in range(len(widths)):
        if i > start and peak_bytes(widths[start:i + 1], rows) > budget_bytes:
            groups.append((start, i))
            start = i
    if widths:
        groups.append((start, len(widths)))
    return groups


def rows_per_prompt(batch: dict, config) -> int:
    """The most input rows one prompt's forward feeds a Linear: its tokens, or its images' tiles x padded patches."""
    rows = int(batch["input_ids"].numel())
    vision = getattr(config, "vision_config", None)
    if "pixel_values" in batch and vision is not None:
        patches = (vision.image_size // vision.patch_size) ** 2 + 1
        rows = max(rows, batch["pixel_values"][0].shape[:-3].numel() * (patches + (8 - patches % 8) % 8))
    return rows


def _inputs(batch: dict, dtype: torch.dtype, device, on_prompt) -> dict:
    batch = model_inputs(batch, dtype, device)
    if on_prompt is not None:
        on_prompt()
    return batch
