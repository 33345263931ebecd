"""Loading the teacher and naming its quantised weights, at any scale.

The same calls serve the toy teacher (a local directory), Llama 3.2 11B Vision Instruct (a hub id or a
local directory) and text-only Llama teachers (``LlamaForCausalLM``: SmolLM2, Llama 3.2 1B/3B, imported by
``python -m pipeline.teacher import``). The config chooses the model class, no flag: a config the
image-text-to-text auto class knows (Mllama) builds that model, any other a causal LM; a text-only model has
a tokenizer where Mllama has a processor. Quantised-weight names are derived from the model built on the
``meta`` device, so listing the 11B model's weights costs no memory.

Tied weights (``tie_word_embeddings``: SmolLM2's ``lm_head`` is its ``embed_tokens``): the checkpoint holds
the matrix once, under the embedding's name, and so does every file of this project. Both modules are
quantised, as the one matrix they share: :func:`checkpoint_names` gives ``lm_head.weight`` the embedding's
checkpoint name, so the fitted state, the packed tensors and the student's weight are the embedding's.
"""

from __future__ import annotations


import torch
from torch import nn

from pipeline.packed.checkpoint import module_to_checkpoint_names
from pipeline.recipe import quantised_modules
from pipeline.teacher.source import local_dir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}")
    return DTYPES[name]


def load_config(source: str):
    from transformers import AutoConfig

    source = str(local_dir(source))
    return AutoConfig.from_pretrained(source)


def is_text_only(config) -> bool:
    """Whether ``config`` is a text-only model (a causal LM such as Llama), not an image-text-to-text one."""
    from transformers import AutoModelForImageTextToText

    return type(config) not in AutoModelForImageTextToText._model_mapping


def auto_class(config):
    """The transformers auto class that builds ``config``'s model: image-text-to-text (Mllama) or causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForCausalLM if is_text_only(config) else AutoModelForImageTextToText


def load_model(source: str, dtype: torch.dtype = torch.bfloat16):
    """The teacher from a directory or hub id (Mllama or a text-only causal LM, as its config says), in eval mode."""
    source = str(local_dir(source))
    model = auto_class(load_config(source)).from_pretrained(source, dtype=dtype)
    return model.eval()


def load_processor(source: str):
    """What turns prompts into ids: Mllama's processor, or a text-only model's tokenizer (with its chat template)."""
    from transformers import AutoProcessor, AutoTokenizer

    source = str(local_dir(source))
    if is_text_only(load_config(source)):
        return AutoTokenizer.from_pretrained(source)
    return AutoProcessor.from_pretrained(source)


def meta_model(config, dtype: torch.dtype | None = None):
    """The model skeleton on the meta device: names and shapes without memory."""
    with torch.device("meta"):
        return auto_class(config).from_config(config, **({"dtype": dtype} if dtype else {}))


def checkpoint_names(model) -> dict[str, str]:
    """:func:`pipeline.packed.checkpoint.module_to_checkpoint_names`, with each tied parameter (transformers'
    ``all_tied_weights_keys``: ``lm_head.weight`` -> ``model.embed_tokens.weight`` under ``tie_word_embeddings``)
    given the checkpoint name of the parameter it is tied to: the one a checkpoint holds."""
    names = module_to_checkpoint_names(model)
    for tied, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if tied in names and source in names:
            names[tied] = names[source]
    return names


def quantised_weight_names(model) -> dict[str, str]:
    """``{module name: checkpoint name of its weight}`` for every module the recipe quantises (tied modules
    share a checkpoint name, see :func:`checkpoint_names`)."""
    names = checkpoint_names(model)
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


def sharding_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that become FSDP2 units, innermost first (the root is sharded last, by the caller)."""
    from transformers import LlamaForCausalLM, MllamaForConditionalGeneration

    if isinstance(model, MllamaForConditionalGeneration):
        inner = model.model
        units = [(f"model.vision_model.transformer.layers.{i}", m)
                 for i, m in enumerate(inner.vision_model.transformer.layers)]
        units += [(f"model.vision_model.global_transformer.layers.{i}", m)
                  for i, m in enumerate(inner.vision_model.global_transformer.layers)]
        language, prefix = inner.language_model, "model.language_model"
    elif isinstance(model, LlamaForCausalLM):
        units, language, prefix = [], model.model, "model"
    else:
        raise ValueError(f"launch.strategy=fsdp2 shards Mllama (MllamaForConditionalGeneration) and Llama "
                         f"(LlamaForCausalLM) models; this model is a {type(model).__name__} (use launch.strategy=ddp)")
    units += [(f"{prefix}.layers.{i}", m) for i, m in enumerate(language.layers)]
    tied = model.lm_head.weight is language.embed_tokens.weight
    units.append((f"{prefix}.embed_tokens", language.embed_tokens))
    if not tied:                                  # tied: one unit holds the shared weight
        units.append(("lm_head", model.lm_head))
    return units
