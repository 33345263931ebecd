"""Which modules the recipe quantises (SPEC section 4), independent of how they are replaced.

Every ``nn.Linear`` and ``nn.Embedding`` of the language and vision models, the projector and ``lm_head``
included; 1-D parameters and the conv patch embedding stay as they are. In a text-only Llama
(``LlamaForCausalLM``) that is every decoder Linear (``q/k/v/o_proj``, ``gate/up/down_proj``), the token
embedding and ``lm_head``; RMSNorm weights and the rotary tables stay. Where ``lm_head`` is tied to
``embed_tokens`` both modules are listed (each is replaced) but they hold one matrix, quantised once under the
embedding's checkpoint name (``pipeline.models.checkpoint_names``). A module that replaced one of
them (a fake-quantised module in QAT, a packed module at inference) subclasses :class:`Quantised`, so a
model keeps the same list whatever state it is in. Everything above (models, QAT, packing) asks here.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

QUANTISED_TYPES = (nn.Linear, nn.Embedding)

STUDENTS = ("direct-cast", "qat")
"""The two models the recipe makes of each format: its direct cast and its QAT student
(``models/packed/<format>/<student>/``)."""


class Quantised(nn.Module):
    """Marks a module that stands in for a quantised ``nn.Linear`` / ``nn.Embedding``."""


def quantised_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` of every module the recipe quantises, in model order."""
    for name, module in model.named_modules():
        if isinstance(module, (*QUANTISED_TYPES, Quantised)):
            yield name, module


def weight_names(model: nn.Module) -> list[str]:
    """State-dict names (``P.weight``) of the quantised weights."""
    return [f"{name}.weight" for name, _ in quantised_modules(model)]


def replace(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` in place of the submodule called ``name``."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
