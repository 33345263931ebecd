"""From (image, prompt, response) to model inputs with response-only labels.

The prompt and the response are tokenised separately and concatenated, so the prompt's ids are exactly those
a model sees at generation time, and the labels cover the response and its ``<|eot_id|>`` only (prompt,
padding and the image token are masked with -100). Used to train the toy teacher; usable for any Mllama
processor (the 11B model's too) wherever a loss on responses is needed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from PIL import Image
from transformers import MllamaProcessor


IGNORE = -100


# A plain-template response continues the prompt's sentence after a space.
PLAIN_SEPARATOR = " "


def encode(
    processor: MllamaProcessor,
    images: Sequence[Image.Image],
    prompts: Sequence[str],
    responses: Sequence[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Right-padded model inputs for templated ``prompts`` (each holding one ``<|image|>``) and, when
    ``responses`` are given, the responses followed by ``<|eot_id|>`` with ``labels`` on them."""
    tok = processor.tokenizer
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    image_id = processor.image_token_id
    rows, label_rows = [], []
    for i, prompt in enumerate(prompts):
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        if ids.count(image_id) != 1:
            raise ValueError(f"prompt {i} must hold exactly one {processor.image_token}: {prompt!r}")
        labels = [IGNORE] * len(ids)
        if responses is not None:
            answer = tok(responses[i], add_special_tokens=False)["input_ids"] + [eot]
            ids = ids + answer
            labels = labels + answer
        rows.append(ids)
        label_rows.append(labels)
    length = max(len(r) for r in rows)
    pad = tok.pad_token_id
    input_ids = torch.full((len(rows), length), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    cross_attention_mask = torch.zeros((len(rows), length, 1, 1), dtype=torch.long)
    for i, (ids, lab) in enumerate(zip(rows, label_rows)):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
        labels[i, : len(lab)] = torch.tensor(lab)
        # as the processor does: text from the image token onwards attends to the image
        cross_attention_mask[i, ids.index(image_id):, 0, 0] = 1
    vision = processor.image_processor(images=[[im.convert("RGB")] for im in images], return_tensors="pt")
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "cross_attention_mask": cross_attention_mask,
        "pixel_values": vision["pixel_values"],
        "aspect_ratio_ids": vision["aspect_ratio_ids"],
        "aspect_ratio_mask": vision["aspect_ratio_mask"],
    }
    if responses is not None:
        batch["labels"] = labels
    return batch
