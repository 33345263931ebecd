"""The prompt sampler: pool size, probabilities, determinism, the fixed-prompt ablation."""

import random
from collections import Counter

import pytest

from pipeline.teacher.prompts import SamplerParams, load_pool, sample
from pipeline.params import defaults


def sampler(**overrides) -> SamplerParams:
    return defaults(SamplerParams, "sample.sampler", **overrides)


def test_pool_has_495_prompts():
    pool = load_pool()
    assert len(pool.prompts) == 495 and len(set(pool.prompts)) == 495


def test_probabilities_match_the_recipe():
    pool, params = load_pool(), sampler()
    rng = random.Random(0)
    draws = [sample(rng, pool, params) for _ in range(20000)]
    chat = sum(d.template == "chat" for d in draws) / len(draws)
    block = [d for d in draws if d.block]
    assert chat == pytest.approx(0.75, abs=0.015)
    assert len(block) / len(draws) == pytest.approx(0.70, abs=0.015)
    lengths = Counter(d.length for d in block if d.length)
    assert sum(lengths.values()) / len(block) == pytest.approx(0.75, abs=0.02)
    assert lengths["short"] / sum(lengths.values()) == pytest.approx(0.40, abs=0.02)
    assert lengths["long"] / sum(lengths.values()) == pytest.approx(0.22, abs=0.02)
    assert sum(d.format is not None for d in block) / len(block) == pytest.approx(0.45, abs=0.02)
    assert sum(d.adherence is not None for d in block) / len(block) == pytest.approx(0.40, abs=0.02)
    assert all(d.block[0] == pool.base_instruction and d.user_text.endswith(d.inner) for d in block)


def test_deterministic_for_a_seed():
    pool, params = load_pool(), sampler()
    a = [sample(random.Random(5), pool, params) for _ in range(3)]
    b = [sample(random.Random(5), pool, params) for _ in range(3)]
    assert a == b


def test_fixed_prompt_ablation():
    params = sampler(fixed_prompt="Describe the image:")
    draws = [sample(random.Random(i), load_pool(), params) for i in range(50)]
    assert {d.user_text for d in draws} == {"Describe the image:"}
    assert {d.template for d in draws} == {"chat", "plain"}


def test_bad_probabilities_are_refused():
    with pytest.raises(ValueError, match="p_chat"):
        sampler(p_chat=1.5)
    with pytest.raises(ValueError, match="length_weights"):
        sampler(length_weights={"short": -1.0})
