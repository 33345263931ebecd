"""The prepare step: swap every module the recipe quantises (``pipeline.recipe``) for its fake-quantised
version."""

from __future__ import annotations

from torch import nn

from pipeline.formats import FormatBase, State
from pipeline.qat.modules import QuantEmbedding, QuantLinear
from pipeline.recipe import quantised_modules, replace


def prepare(model: nn.Module, fmt: FormatBase, states: dict[str, State], act_quant: bool = True,
            scales: dict | None = None, other: dict[str, FormatBase | None] | None = None) -> list[str]:
    """Swap every quantised module of ``model`` (in place) for its fake-quantised version in format ``fmt``.

    ``states`` maps a module name to its fitted state; a module without one is an error that names
    it (the fitted-state file does not match this model). ``scales`` (module name -> initial scale) makes
    the scales trained parameters (``QuantLinear.qat_scale``). ``other`` (module name -> format, or None to leave
    the module as it is) is the precision plan's choice where it differs from ``fmt``.
    """
    swapped = []
    other = other or {}
    for name, module in list(quantised_modules(model)):
        fmt_here = other.get(name, fmt)
        if fmt_here is None:
            continue
        if name not in states:
            raise ValueError(f"fitted state for format {fmt.name!r} has no entry for module {name!r} "
                             f"(was it fitted on another model?)")
        scale = None if scales is None else scales[name]
        if isinstance(module, nn.Linear):
            replace(model, name, QuantLinear(module, fmt_here, states[name], act_quant, scale))
        elif isinstance(module, nn.Embedding):
            replace(model, name, QuantEmbedding(module, fmt_here, states[name], scale))
        swapped.append(name)
    return swapped
