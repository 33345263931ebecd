"""Fitting a format's state (S3D8 tables, code points) to every quantised weight of a model, streaming its
checkpoint one tensor at a time (so the 11B model is fitted in the memory of its largest matrix)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.packed.checkpoint import CheckpointReader
from pipeline.formats import FormatBase, State
from pipeline.models import load_config, meta_model, quantised_weight_names
from pipeline.section import non_negative
from pipeline.stage import progress
from pipeline.teacher.source import local_dir


@dataclass
class FitParams:
    seed: int
    threads: int = non_negative()  # 0: torch's default


def fit_model(fmt: FormatBase, source: str, seed: int = 0) -> tuple[dict[str, State], dict]:
    """Fit ``fmt`` to every weight the recipe quantises in the checkpoint ``source`` (Mllama or a text-only
    Llama; a matrix tied to another, such as ``lm_head`` to ``embed_tokens``, is fitted once).

    Returns the states keyed by checkpoint path (``P`` of ``P.weight``) and a report: per matrix and
    overall, the relative RMSE of the quantised weight and the bits per parameter. All-zero rows (an
    embedding's padding row) are counted apart: their error is real but would drown every other row's."""
    root = local_dir(source)
    # tied modules (a Llama's lm_head and embed_tokens) share one checkpoint tensor: fitted once
    saved_names = list(dict.fromkeys(quantised_weight_names(meta_model(load_config(str(root)))).values()))
    reader = CheckpointReader(root)
    states, layers = {}, {}
    params = bits = err = energy = 0.0
    zero_rows_total = 0
    with progress() as bar:
        task = bar.add_task(f"fit {fmt.name}", total=len(saved_names))
        for saved in saved_names:
            weight = reader.get(saved).float()
            try:
                state = fmt.fit(weight, seed=seed)
            except ValueError as e:
                raise ValueError(f"{root}: tensor {saved!r}: {e}") from None
            # in place, and no full-size mask or copy where no row is zero: a matrix at a time, the largest one
            # sets the stage's memory (three float32 copies of it)
            sq_err = fmt.quantize(weight, state).sub_(weight).pow_(2)
            zero_rows = (weight.amax(dim=1) == 0) & (weight.amin(dim=1) == 0)
            if bool(zero_rows.any()):
                e, zero_err = sq_err[~zero_rows].sum().item(), sq_err[zero_rows].sum().item()
            else:
                e, zero_err = sq_err.sum().item(), 0.0
            del sq_err
            w2 = weight.pow(2).sum().item()
            bpp = fmt.bits_per_param(tuple(weight.shape))
            states[saved.removesuffix(".weight")] = state
            layers[saved] = {"shape": list(weight.shape), "rel_rmse": (e / w2) ** 0.5 if w2 else 0.0,
                             "zero_rows": int(zero_rows.sum()), "zero_rows_sq_error": zero_err, "bits_per_param": bpp}
            params += weight.numel()
            bits += bpp * weight.numel()
            err += e
            energy += w2
            zero_rows_total += int(zero_rows.sum())
            bar.advance(task)
    summary = {"matrices": len(layers), "quantised_params": int(params), "bits_per_param": bits / params,
               "rel_rmse": (err / energy) ** 0.5, "zero_rows": zero_rows_total}
    return states, {"summary": summary, "layers": layers}


def check_states(fmt: FormatBase, states: dict[str, State], path) -> dict[str, State]:
    """Fitted states read back for use: every state tensor present and finite."""
    for module, st in states.items():
        for key, t in st.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"{path}: state {module}.weight.{key} holds NaN or Inf")
    return states
