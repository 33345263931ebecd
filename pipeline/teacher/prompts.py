"""The prompt sampler of SPEC section 5: generic image prompts in varied templates and instructions.

A prompt is a template (the chat template with probability ``p_chat``, else plain ``<|image|>{text}``)
around a user text: an inner prompt from the pool of 495 and, with probability ``p_instruction``, an
instruction block prepended to it (a base instruction; a length instruction with probability
``p_length``; a format instruction with ``p_format``; an adherence probe with ``p_adherence``).
``fixed_prompt`` replaces all of this by one prompt (the paper's "Describe the image:" ablation).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import yaml

from pipeline.section import probability

_REPO_POOL = Path(__file__).resolve().parents[2] / "data" / "prompts" / "prompt_pool.yaml"
DEFAULT_POOL = _REPO_POOL if _REPO_POOL.exists() else Path(__file__).resolve().parents[1] / "data" / "prompt_pool.yaml"
"""The repository's pool, or the copy an installed package carries."""


@dataclass(frozen=True)
class PromptPool:
    prompts: tuple[str, ...]                 # the base prompts, then the composed ones
    base_instruction: str
    lengths: dict[str, tuple[float, str]]    # name -> (default probability, text)
    formats: dict[str, str]                  # name -> text
    probes: tuple[str, ...]


@lru_cache(maxsize=4)
def load_pool(path: str | Path = DEFAULT_POOL) -> PromptPool:
    """Read the pool file: base prompts plus ``compose`` over actions x targets x audiences x styles."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: prompt pool not found")
    doc = yaml.safe_load(path.read_text())
    try:
        composed = [doc["compose"].format(action=a, target=t, audience=u, style=s)
                    for a in doc["actions"] for t in doc["targets"]
                    for u in doc["audiences"] for s in doc["styles"]]
        ins = doc["instructions"]
        return PromptPool(
            prompts=tuple(doc["base_prompts"]) + tuple(composed),
            base_instruction=ins["base"],
            lengths={k: (float(v["p"]), v["text"]) for k, v in ins["length"].items()},
            formats=dict(ins["format"]),
            probes=tuple(ins["adherence"]),
        )
    except KeyError as e:
        raise ValueError(f"{path}: prompt pool lacks key {e}") from None


@dataclass
class SamplerParams:
    """``sample.sampler`` in ``params.yaml``."""
    p_chat: float = probability()
    p_instruction: float = probability()
    p_length: float = probability()
    length_weights: dict[str, float]
    p_format: float = probability()
    p_adherence: float = probability()
    fixed_prompt: str | None

    def __post_init__(self) -> None:
        if not self.length_weights or any(w < 0 for w in self.length_weights.values()) \
                or sum(self.length_weights.values()) <= 0:
            raise ValueError(f"parameter 'length_weights': needs non-negative weights with a positive sum, "
                             f"got {self.length_weights}")


@dataclass(frozen=True)
class SampledPrompt:
    inner: str
    template: str                     # "chat" or "plain"
    instruction: str | None = None    # the base instruction, when a block was added
    length: str | None = None         # "short" / "medium" / "long"
    format: str | None = None         # a key of the pool's formats
    adherence: str | None = None      # the probe's text
    block: tuple[str, ...] = ()       # the instruction sentences, in order

    @property
    def user_text(self) -> str:
        """What the user says: the instruction block (if any), then the inner prompt."""
        return "\n".join([" ".join(self.block), self.inner]) if self.block else self.inner


def sample(rng: random.Random, pool: PromptPool, params: SamplerParams) -> SampledPrompt:
    """Draw one prompt. Every draw consumes the same random numbers, so a change of one probability
    does not reshuffle the rest of the stream more than it must."""
    template = "chat" if rng.random() < params.p_chat else "plain"
    if params.fixed_prompt is not None:
        return SampledPrompt(inner=params.fixed_prompt, template=template)
    inner = rng.choice(pool.prompts)
    draws = [rng.random() for _ in range(4)]
    length_name = rng.choices(sorted(params.length_weights),
                              weights=[params.length_weights[k] for k in sorted(params.length_weights)])[0]
    format_name = rng.choice(sorted(pool.formats))
    probe = rng.choice(pool.probes)
    if draws[0] >= params.p_instruction:
        return SampledPrompt(inner=inner, template=template)
    unknown = set(params.length_weights) - set(pool.lengths)
    if unknown:
        raise ValueError(f"parameter 'length_weights': lengths {sorted(unknown)} are not in the pool "
                         f"(known: {sorted(pool.lengths)})")
    block = [pool.base_instruction]
    length = fmt = adherence = None
    if draws[1] < params.p_length:
        length = length_name
        block.append(pool.lengths[length][1])
    if draws[2] < params.p_format:
        fmt = format_name
        block.append(pool.formats[fmt])
    if draws[3] < params.p_adherence:
        adherence = probe
        block.append(probe)
    return SampledPrompt(inner=inner, template=template, instruction=pool.base_instruction,
                         length=length, format=fmt, adherence=adherence, block=tuple(block))


def render(prompt: SampledPrompt, processor) -> str:
    """The full prompt text (BOS and ``<|image|>`` included), ready to tokenise without special tokens."""
    from pipeline.chat import chat_prompt, plain_prompt

    return (chat_prompt if prompt.template == "chat" else plain_prompt)(processor, prompt.user_text)
