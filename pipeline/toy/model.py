"""A tiny MllamaConfig and model: the real architecture (vision encoder with global layers and intermediate
features, projector, language model with gated cross-attention layers), at a size that trains on one CPU core."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import MllamaConfig, MllamaForConditionalGeneration, MllamaTextConfig, MllamaVisionConfig

from pipeline.toy.draw import IMAGE_SIZE


@dataclass
class ModelSize:
    """Sizes of the tiny Mllama (``params.yaml``: ``toy_teacher.model``)."""

    patch_size: int
    vision_hidden: int
    vision_layers: int
    vision_global_layers: int
    vision_heads: int
    vision_intermediate: int
    vision_intermediate_layers: list[int]
    text_hidden: int
    text_layers: int
    cross_attention_layers: list[int]
    text_heads: int
    text_kv_heads: int
    text_intermediate: int
    max_position_embeddings: int
    rope_theta: float


def tiny_config(size: ModelSize, vocab_size: int, image_size: int = IMAGE_SIZE) -> MllamaConfig:
    """``vocab_size`` is the language model's vocabulary; the image token takes the next id, as in the 11B
    model (128256). BOS 0, EOS [1, 8, 9] (end of text, end of message, end of turn), PAD 4: the Llama 3
    specials in the same order."""
    if image_size % size.patch_size:
        raise ValueError(f"image_size {image_size} is not a multiple of model.patch_size {size.patch_size}")
    bad = [i for i in size.cross_attention_layers if not 0 <= i < size.text_layers]
    if bad:
        raise ValueError(f"model.cross_attention_layers {bad} outside 0..{size.text_layers - 1}")
    vision = MllamaVisionConfig(
        hidden_size=size.vision_hidden,
        num_hidden_layers=size.vision_layers,
        num_global_layers=size.vision_global_layers,
        attention_heads=size.vision_heads,
        intermediate_size=size.vision_intermediate,
        intermediate_layers_indices=list(size.vision_intermediate_layers),
        vision_output_dim=size.vision_hidden * (1 + len(size.vision_intermediate_layers)),
        image_size=image_size,
        patch_size=size.patch_size,
        max_num_tiles=1,
        supported_aspect_ratios=[[1, 1]],
    )
    text = MllamaTextConfig(
        vocab_size=vocab_size,
        hidden_size=size.text_hidden,
        num_hidden_layers=size.text_layers,
        cross_attention_layers=list(size.cross_attention_layers),
        num_attention_heads=size.text_heads,
        num_key_value_heads=size.text_kv_heads,
        intermediate_size=size.text_intermediate,
        max_position_embeddings=size.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": size.rope_theta},
        bos_token_id=0,
        eos_token_id=[1, 8, 9],
        pad_token_id=4,
    )
    return MllamaConfig(vision_config=vision, text_config=text, image_token_index=vocab_size)


def build_model(config: MllamaConfig, seed: int, position_std: float = 0.5) -> MllamaForConditionalGeneration:
    """A freshly initialised model, deterministic for ``seed``.

    Two departures from the library's initialisation, both for training from scratch:
    - the tanh gates of the cross-attention layers (and of the vision model's global layers) start at 1.0
      instead of 0: with zero gates the image barely reaches the language model for hundreds of steps
      (see the toy-mllama feasibility notes);
    - the vision patch position embedding starts with std ``position_std`` instead of 0.02, comparable to
      the patch embeddings themselves, so that the encoder knows where a patch is from the first step."""
    torch.manual_seed(seed)
    model = MllamaForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate", "gate_attn", "gate_ffn")):
                p.fill_(1.0)
        model.model.vision_model.gated_positional_embedding.embedding.normal_(0.0, position_std)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
