"""The teacher's answers as data: its prompts and answers (and, for a text-only Llama, windows of plain text) read
from teacher-generate's shards, split into training and held-out answers, and batched for Mllama or a text-only
Llama (no image inputs); what QAT trains on, what calibration reads and what eval scores.

A sequence is the prompt's token ids followed by the teacher's response ids (its end-of-turn token
included), cut to ``max_seq_len``; the loss mask marks the positions whose *next* token is a response
token. Batches are right-padded; images are re-created from their references and preprocessed by the
teacher's own image processor; the cross-attention mask is built the way ``MllamaProcessor`` builds
it, over the whole sequence.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.models.mllama.processing_mllama import (
    convert_sparse_cross_attention_mask_to_dense,
    get_cross_attention_token_mask,
)

from pipeline.chat import is_text_only, tokenizer_of
from pipeline.teacher.images import load_image

COLUMNS = ["index", "image_ref", "prompt_ids", "response_ids"]


@dataclass(frozen=True)
class Example:
    index: int
    image_ref: str | None          # None: a text-only prompt
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]


def load_examples(directory: str | Path, vocab_size: int | None = None) -> list[Example]:
    """Every teacher answer in the shards of ``directory``, in prompt order.

    Token ids must be whole numbers >= 0 (below ``vocab_size`` when it is given: the model's vocabulary)
    and every prompt non-empty; anything else, or an image reference that is not a string, is a
    ``ValueError`` naming the shard file and the row."""
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1):
        raise ValueError(f"vocab_size: expected a whole number >= 1, got {vocab_size!r}")
    from pipeline.files.shards import read_shard, shard_paths     # pyarrow, an extra: collate and the rest are core

    examples = []
    for path in shard_paths(directory):
        table, _ = read_shard(path, COLUMNS)
        for row in table.select(COLUMNS).to_pylist():
            examples.append(_example(path, row, vocab_size))
    examples.sort(key=lambda e: e.index)
    return examples


def _example(path: Path, row: dict, vocab_size: int | None) -> Example:
    index = row["index"]
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"{path}: row index {index!r}: expected a whole number >= 0")
    if row["image_ref"] is not None and (not isinstance(row["image_ref"], str) or not row["image_ref"]):
        raise ValueError(f"{path}: prompt {index}: image_ref {row['image_ref']!r} is not a reference string "
                         f"(or null, for a text-only prompt)")
    ids = {}
    for column in ("prompt_ids", "response_ids"):
        values = row[column]
        if not isinstance(values, list):
            raise ValueError(f"{path}: prompt {index}: {column} is {type(values).__name__}, not a list of token ids")
        for pos, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{path}: prompt {index}: {column}[{pos}] = {v!r} is not a whole-number token id")
            if v < 0 or (vocab_size is not None and v >= vocab_size):
                bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise ValueError(f"{path}: prompt {index}: {column}[{pos}] = {v} is outside the vocabulary {bound}")
        ids[column] = tuple(values)
    if not ids["prompt_ids"]:
        raise ValueError(f"{path}: prompt {index}: prompt_ids is empty (a sequence starts with its prompt)")
    return Example(index, row["image_ref"], ids["prompt_ids"], ids["response_ids"])


def split_heldout(examples: list[Example], heldout: int) -> tuple[list[Example], list[Example]]:
    """``(training, held-out)``: the last ``heldout`` prompts (by index) are never trained on, and evaluation measures
    KL on those of them whose prompt (image and tokens) no training answer also has: a prompt drawn twice from the
    pool is answered from the same distribution both times, so scoring it would score a prompt the student was trained
    on."""
    if heldout < 0 or heldout >= len(examples):
        raise ValueError(f"parameter heldout_prompts={heldout}: must be in [0, {len(examples)}) "
                         f"for {len(examples)} teacher answers")
    if not heldout:
        return examples, []
    train = examples[:-heldout]
    seen = {(e.image_ref, e.prompt_ids) for e in train}
    return train, [e for e in examples[-heldout:] if (e.image_ref, e.prompt_ids) not in seen]


def text_examples(windows: list[list[int]], first_index: int) -> list[Example]:
    """Windows of plain text as training sequences: the first token is the prompt, every later token is
    distilled (the teacher's distribution at each position). Indices follow ``first_index``."""
    short = [i for i, w in enumerate(windows) if len(w) < 2]
    if short:
        raise ValueError(f"text window {short[0]}: fewer than 2 tokens")
    return [Example(first_index + i, None, (w[0],), tuple(w[1:])) for i, w in enumerate(windows)]


GROUP_BY_LENGTH_BATCHES = 50
"""Batches per megabatch of ``batch_indices(..., lengths=)`` (Hugging Face's ``LengthGroupedSampler``'s 50)."""


def sequence_lengths(examples: list[Example], max_seq_len: int) -> list[int]:
    """Each example's tokens as :func:`collate` cuts it."""
    return [min(len(e.prompt_ids) + len(e.response_ids), max_seq_len) for e in examples]


def batch_indices(n_examples: int, batch_size: int, step: int, seed: int,
                  lengths: list[int] | None = None) -> list[int]:
    """The examples of optimizer step ``step``: consecutive slices of seeded per-epoch permutations,
    a pure function of (step, seed) so that a resumed run sees the same data. With ``lengths`` (``qat.group_by_length``,
    as Hugging Face's ``group_by_length``): each permutation is cut into megabatches of
    ``GROUP_BY_LENGTH_BATCHES`` batches, each sorted longest first, so that a batch holds sequences of about one length
    and pads little."""
    out = []
    position = step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(position, n_examples)
        order = list(range(n_examples))
        random.Random(f"{seed}/{epoch}").shuffle(order)
        if lengths is not None:
            mega = GROUP_BY_LENGTH_BATCHES * batch_size
            order = [i for a in range(0, n_examples, mega)
                     for i in sorted(order[a:a + mega], key=lambda i: -lengths[i])]
        take = min(batch_size - len(out), n_examples - offset)
        out.extend(order[offset:offset + take])
        position += take
    return out


def collate(examples: list[Example], processor, max_seq_len: int,
            pool: str | None = None) -> dict[str, torch.Tensor]:
    """Model inputs plus ``loss_mask`` for a list of examples (right padding). With ``pool`` (the
    ``sample.images`` spec) every image reference must lie inside that pool. ``processor`` None: a text-only
    model's batch padded with id 0 (the attention mask hides it)."""
    seqs, masks = [], []
    for e in examples:
        if not e.prompt_ids:
            raise ValueError(f"prompt {e.index}: prompt_ids is empty (the loss mask needs a prompt)")
        if len(e.prompt_ids) >= max_seq_len:
            raise ValueError(f"prompt {e.index} has {len(e.prompt_ids)} tokens, not below "
                             f"max_seq_len={max_seq_len}: raise qat.max_seq_len")
        ids = list(e.prompt_ids + e.response_ids)[:max_seq_len]
        mask = [0] * len(ids)
        for pos in range(len(e.prompt_ids) - 1, len(ids) - 1):
            mask[pos] = 1                       # position pos predicts response token pos + 1
        seqs.append(ids)
        masks.append(mask)
    length = max(len(s) for s in seqs)
    pad = 0 if processor is None else tokenizer_of(processor).pad_token_id
    input_ids = torch.full((len(seqs), length), pad, dtype=torch.long)
    attention = torch.zeros((len(seqs), length), dtype=torch.long)
    loss_mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        input_ids[i, :len(s)] = torch.tensor(s)
        attention[i, :len(s)] = 1
        loss_mask[i, :len(m)] = torch.tensor(m)
    if processor is None or is_text_only(processor):
        if any(e.image_ref is not None for e in examples):
            raise ValueError(f"prompt {next(e.index for e in examples if e.image_ref is not None)}: an image "
                             f"reference, but the teacher is a text-only model")
        return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask}
    missing = [e.index for e in examples if e.image_ref is None]
    if missing:
        raise ValueError(f"prompt {missing[0]}: no image reference, but the teacher is an image-text model")
    images = processor.image_processor(images=[[load_image(e.image_ref, pool)] for e in examples], return_tensors="pt")
    num_tiles = images.pop("num_tiles")
    sparse = [get_cross_attention_token_mask(s, processor.image_token_id) for s in seqs]
    cross = convert_sparse_cross_attention_mask_to_dense(sparse, num_tiles=num_tiles,
                                                         max_num_tiles=processor.image_processor.max_image_tiles,
                                                         length=length)
    return {"input_ids": input_ids, "attention_mask": attention, "cross_attention_mask": torch.from_numpy(cross),
            "pixel_values": images["pixel_values"], "aspect_ratio_ids": images["aspect_ratio_ids"],
            "aspect_ratio_mask": images["aspect_ratio_mask"], "loss_mask": loss_mask}


def model_inputs(batch: dict[str, torch.Tensor], dtype: torch.dtype, device=None) -> dict[str, torch.Tensor]:
    """What the model takes of a :func:`collate` batch: everything but ``loss_mask``, on ``device`` when given,
    with the image pixels (Mllama's only) in the model's ``dtype``."""
    out = {k: (v.to(device) if device is not None else v) for k, v in batch.items() if k != "loss_mask"}
    if "pixel_values" in out:
        out["pixel_values"] = out["pixel_values"].to(dtype)
    return out


def check_heldout(value) -> int:
    """The ``heldout_prompts`` parameter: how many of the last teacher answers are never trained on."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a whole number >= 0, got {value!r}")
    return value
