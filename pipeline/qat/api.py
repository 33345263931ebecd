"""Which modules are quantised, and the prepare step that swaps them for fake-quantised ones.

SPEC section 4: every ``nn.Linear`` and ``nn.Embedding`` of the language and vision models, the
projector and ``lm_head`` included; 1-D parameters and the conv patch embedding stay as they are.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from pipeline.formats import State
from pipeline.qat.modules import QuantEmbedding, QuantLinear

QUANTISED_TYPES = (nn.Linear, nn.Embedding)


def quantised_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` of every module the recipe quantises, in model order."""
    for name, module in model.named_modules():
        if isinstance(module, QUANTISED_TYPES) or isinstance(module, (QuantLinear, QuantEmbedding)):
            yield name, module


def weight_names(model: nn.Module) -> list[str]:
    """State-dict names (``P.weight``) of the quantised weights."""
    return [f"{name}.weight" for name, _ in quantised_modules(model)]


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def prepare(model: nn.Module, fmt: str, states: dict[str, State], act_quant: bool = True) -> list[str]:
    """Swap every quantised module of ``model`` (in place) for its fake-quantised version.

    ``states`` maps a module name to its fitted state; a module without one is an error that names
    it (the fitted-state file does not match this model).
    """
    swapped = []
    for name, module in list(quantised_modules(model)):
        if name not in states:
            raise ValueError(f"fitted state for format {fmt!r} has no entry for module {name!r} "
                             f"(was it fitted on another model?)")
        if isinstance(module, nn.Linear):
            _set(model, name, QuantLinear(module, fmt, states[name], act_quant))
        elif isinstance(module, nn.Embedding):
            _set(model, name, QuantEmbedding(module, fmt, states[name]))
        swapped.append(name)
    return swapped
