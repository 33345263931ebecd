"""QAT's two steps around training: ``prepare`` swaps every module the recipe quantises (``pipeline.recipe``) for its
fake-quantised version; ``convert`` gives the packer the trained student's quantiser state and learned scales."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open
from torch import nn

from pipeline.formats import FormatBase, State
from pipeline.formats.precision import Precision
from pipeline.qat.engines import QAT_STATE
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


def convert(student_dir: str | Path, plan: Precision):
    """The convert step (torchao's ``prepare`` / ``convert``): how a trained student's weights become packed
    tensors, ``encode(name, weight, state) -> {suffix: tensor}``, at the quantiser state (``P.table`` /
    ``P.codepoints``) and learned scales (``P.scale``) of its ``qat_state.safetensors``; absmax scales where none were
    learned. Each weight in the precision plan's format."""
    fmt = plan.default
    path = Path(student_dir) / QAT_STATE
    if not path.exists():
        raise ValueError(f"{path}: missing (a student trained before learned scales existed? re-run qat-train)")
    with safe_open(str(path), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
        trained_format = (f.metadata() or {}).get("format")
    if trained_format != fmt.name:
        raise ValueError(f"{path}: written for format {trained_format!r}, not {fmt.name!r}")

    def encode(name, weight, state):
        f = plan.format_of(name)
        state = {k: saved.get(f"{name}.{k}", v) for k, v in state.items()} if f is fmt else {}
        scale = saved.get(f"{name}.scale")
        return f.pack(weight, state) if scale is None else f.pack_at_scale(weight, state, scale)

    return encode
