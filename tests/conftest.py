"""Shared fixtures: a tiny random Mllama model saved like a Hugging Face checkpoint."""

from __future__ import annotations

import pipeline.cpu_numerics  # noqa: F401  (first: the stages' CPU code path, so a stage run in-process runs as it does alone)
import pytest
import torch

# One thread per test process: the suite's timings stay predictable on a 2-core machine, and
# nothing here depends on intra-op parallelism (the native kernels take their thread count explicitly).
torch.set_num_threads(1)


def tiny_mllama(seed: int = 0):
    from transformers import MllamaConfig, MllamaForConditionalGeneration
    from transformers.models.mllama.configuration_mllama import MllamaTextConfig, MllamaVisionConfig

    vision = MllamaVisionConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                num_global_layers=1, attention_heads=2, intermediate_size=64, max_num_tiles=1,
                                supported_aspect_ratios=[[1, 1]], intermediate_layers_indices=[0, 1],
                                vision_output_dim=96)
    text = MllamaTextConfig(vocab_size=60, hidden_size=48, num_hidden_layers=3, cross_attention_layers=[1],
                            num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                            max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                            bos_token_id=0, eos_token_id=[1], pad_token_id=4)
    torch.manual_seed(seed)
    return MllamaForConditionalGeneration(MllamaConfig(vision_config=vision, text_config=text, image_token_index=60)).eval()


def tiny_inputs(batch: int = 2, length: int = 7, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 60, (batch, length), generator=gen)
    ids[:, 1] = 60                                  # the image token
    return {
        "input_ids": ids,
        "attention_mask": torch.ones(batch, length, dtype=torch.long),
        "pixel_values": torch.randn(batch, 1, 1, 3, 32, 32, generator=gen),
        "aspect_ratio_ids": torch.ones(batch, 1, dtype=torch.long),
        "aspect_ratio_mask": torch.ones(batch, 1, 1, dtype=torch.long),
        "cross_attention_mask": torch.ones(batch, length, 1, 1, dtype=torch.long),
    }


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A saved tiny Mllama (float32) and its directory."""
    path = tmp_path_factory.mktemp("tiny-mllama")
    model = tiny_mllama()
    model.save_pretrained(path)
    return path
