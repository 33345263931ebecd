"""Loading the teacher and naming its quantised weights, at any scale.

The same calls serve the toy teacher (a local directory) and Llama 3.2 11B Vision Instruct (a hub id
or a local directory). Quantised-weight names are derived from the model built on the ``meta``
device, so listing the 11B model's weights costs no memory.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.checkpoint import module_to_checkpoint_names
from pipeline.recipe import quantised_modules
from pipeline.teacher import local_dir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}")
    return DTYPES[name]


def load_config(source: str):
    from transformers import AutoConfig

    source = str(local_dir(source))
    return AutoConfig.from_pretrained(source)


def load_model(source: str, dtype: torch.dtype = torch.bfloat16):
    """``AutoModelForImageTextToText`` from a directory or hub id, in eval mode."""
    from transformers import AutoModelForImageTextToText

    source = str(local_dir(source))
    model = AutoModelForImageTextToText.from_pretrained(source, dtype=dtype)
    return model.eval()


def load_processor(source: str):
    from transformers import AutoProcessor

    source = str(local_dir(source))
    return AutoProcessor.from_pretrained(source)


def meta_model(config, dtype: torch.dtype | None = None):
    """The model skeleton on the meta device: names and shapes without memory."""
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(config, **({"dtype": dtype} if dtype else {}))


def quantised_weight_names(model) -> dict[str, str]:
    """``{module name: checkpoint name of its weight}`` for every module the recipe quantises."""
    names = module_to_checkpoint_names(model)
    return {module: names[f"{module}.weight"] for module, _ in quantised_modules(model)}


def states_by_module(model, states: dict[str, dict]) -> dict[str, dict]:
    """Re-key fitted states from checkpoint weight names (``P`` of ``P.weight``) to module names."""
    mapping = quantised_weight_names(model)
    return {module: states[saved.removesuffix(".weight")] for module, saved in mapping.items()
            if saved.removesuffix(".weight") in states}


def token_ids(config) -> int:
    """How many token ids a prompt may hold: the text vocabulary and, for Mllama, the image token (added after
    the vocabulary: its id may equal the text vocabulary size)."""
    return max(config.get_text_config().vocab_size, getattr(config, "image_token_index", -1) + 1)
