"""Post-training quantisation: how a weight is cast to a format without training. This module checks the
arguments and chooses the algorithm; each format does the numerics (``fmt.search``, ``fmt.gptq``, in its own module
under ``pipeline/formats/``, with what they share in ``pipeline.formats.numerics``).

Algorithms (``ALGORITHMS``), for every comparison format:

- ``absmax``: the paper's rule, the format's own ``fit`` and ``pack`` (absmax scales; for S3D8 the
  table fitted on absmax-normalised 3-vectors). Equal to ``fmt.quantize`` bit for bit.
- ``search``: scale search. Each scale (S3D8: per row; 6-level formats: per block) is chosen to
  minimise the (importance-weighted) reconstruction error: a clipping grid ``alpha * absmax / qmax``
  (``numerics.ALPHAS``), then closed-form least-squares refinements given the codes,
  ``s = <w, t>_h / <t, t>_h``, each candidate kept only where it lowers the error. For S3D8 the three
  rows that share a byte are chosen jointly (a candidate is judged on the error of the whole 3-row
  group, since the codes of one row depend on the other two), and the centroid table is refitted by
  weighted k-means on the data normalised by the searched scales, alternating ``numerics.ROUNDS`` times; for
  lloyd-max the 6 code points are refitted the same way (INT's and student-t's code points are the
  format's definition and stay). The result is never worse than ``absmax`` on the objective: the
  absmax cast is the first candidate and the best of all (table, scales) pairs is returned.
- ``gptq``: GPTQ (error feedback column by column through the Cholesky factor of the inverse
  Hessian ``H = X^T X``) on top of the ``search`` scales and table (fitted with ``diag(H)`` as the
  importance). For S3D8 each column's 3-row groups are quantised by nearest centroid; for the 6-level
  formats each weight by nearest code point with its block's scale. Afterwards each row's S3D8 scale is
  refitted in closed form for the output error ``(w - s t) H (w - s t)^T`` (codes kept). It needs the
  full Hessian (``hessian=``): given only ``importance`` (the diagonal), error feedback has no
  off-diagonal terms to use, and ``gptq`` is then exactly ``search`` with that importance (documented,
  tested); given neither it is the unweighted ``search``.

The weighting: ``importance`` is ``diag(X^T X)`` per input channel (see :func:`collect_importance`),
a weight's squared error counts ``importance[column]`` times. Its overall scale does not matter.

Every algorithm returns the packed tensors a packer writes (:func:`pack`) and their decoded weight
(:func:`direct_cast`, equal to ``fmt.unpack(pack(...))`` bit for bit). Deterministic for a seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from pipeline.formats.base import FormatBase, State, check_weight
from pipeline.formats.numerics import GPTQ_ACT_ORDER
from pipeline.formats.precision import check_rules

Algorithm = Literal["absmax", "search", "gptq"]
ALGORITHMS = get_args(Algorithm)


@dataclass
class PackParams:
    """The ``pack`` section of ``params.yaml``: read by direct-cast, qat-train (the algorithm) and pack-safetensors."""
    dtype: str                  # of the tensors that are not quantised
    algorithm: Algorithm        # the direct cast's post-training algorithm
    precision: dict[str, str]   # the precision plan: {regex on the weight name: format} (pipeline.formats.precision)

    def __post_init__(self) -> None:
        check_rules(self.precision)


# --- argument checks ------------------------------------------------------------------------------

def check_algorithm(algorithm: str) -> str:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: expected one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    return algorithm


def check_importance(importance: torch.Tensor | None, d_in: int, what: str = "importance") -> torch.Tensor | None:
    """``None``, or ``d_in`` finite values >= 0, not all zero; returned as float32 with mean 1."""
    if importance is None:
        return None
    if not isinstance(importance, torch.Tensor) or not importance.is_floating_point():
        raise ValueError(f"{what}: expected a floating-point tensor of {d_in} values, got "
                         f"{importance.dtype if isinstance(importance, torch.Tensor) else type(importance).__name__}")
    if importance.numel() != d_in:
        raise ValueError(f"{what}: expected {d_in} values (one per input channel), got shape {list(importance.shape)}")
    h = importance.detach().reshape(-1).double()
    if not bool(torch.isfinite(h).all()):
        raise ValueError(f"{what}: contains NaN or Inf (first at index {int((~torch.isfinite(h)).nonzero()[0, 0])})")
    if bool((h < 0).any()):
        raise ValueError(f"{what}: must be >= 0 (index {int((h < 0).nonzero()[0, 0])} is {float(h[h < 0][0])})")
    if float(h.sum()) <= 0:
        raise ValueError(f"{what}: all zero (no input channel carries any signal)")
    return (h / h.mean()).float()


def check_hessian(hessian: torch.Tensor | None, d_in: int) -> torch.Tensor | None:
    """``None``, or a finite symmetric ``[d_in, d_in]`` matrix with a non-negative, non-zero diagonal."""
    if hessian is None:
        return None
    if not isinstance(hessian, torch.Tensor) or not hessian.is_floating_point():
        raise ValueError("hessian: expected a floating-point tensor [d_in, d_in]")
    if tuple(hessian.shape) != (d_in, d_in):
        raise ValueError(f"hessian: expected shape [{d_in}, {d_in}], got {list(hessian.shape)}")
    h = hessian.detach().double()
    if not bool(torch.isfinite(h).all()):
        raise ValueError("hessian: contains NaN or Inf")
    if not torch.allclose(h, h.T, rtol=1e-4, atol=1e-6 * float(h.diagonal().abs().max().clamp(min=1e-30))):
        raise ValueError("hessian: must be symmetric (X^T X)")
    check_importance(h.diagonal().float(), d_in, "hessian diagonal")
    return (h / h.diagonal().mean()).float()


# --- the contract -----------------------------------------------------------------------------------

def pack(fmt: FormatBase, weight: torch.Tensor, *, algorithm: str,
         importance: torch.Tensor | None = None, hessian: torch.Tensor | None = None, seed: int = 0,
         fitted: State | None = None, compensated: torch.Tensor | None = None,
         act_order: bool = GPTQ_ACT_ORDER) -> dict[str, torch.Tensor]:
    """The packed tensors (``{suffix: tensor}``, as ``fmt.pack`` lays them out) of ``weight`` cast to format
    ``fmt`` by ``algorithm`` (``absmax``, the only one for the formats outside the comparison: int8, bf16; the
    stages take it from parameter ``pack.algorithm``). What a packer writes. ``fitted``: the format's
    ``fit(weight, seed)`` when already at hand (stage fit-centroids' state of this weight), which every algorithm
    starts from; fitted here otherwise. ``compensated`` (float32 ``[d_out, d_in]``, for :func:`cast`) receives
    GPTQ's error-compensated weights when the algorithm runs GPTQ, else stays untouched. ``act_order``: GPTQ takes the
    columns by decreasing ``H[k, k]`` (parameter ``calibrate.act_order``; ``numerics.gptq``)."""
    check_weight(weight)
    algorithm = check_algorithm(algorithm)
    d_in = weight.shape[1]
    importance = check_importance(importance, d_in)
    hessian = check_hessian(hessian, d_in)
    if hessian is not None and importance is not None:
        raise ValueError("importance and hessian: give one (the hessian's diagonal is the importance)")
    if algorithm == "absmax" or not fmt.comparison:
        if algorithm != "absmax":
            raise ValueError(f"algorithm {algorithm!r}: format {fmt.name!r} has only 'absmax'")
        return fmt.pack(weight.detach(), fmt.fit(weight, seed=seed) if fitted is None else fitted)
    if algorithm == "gptq" and hessian is None:
        algorithm = "search"          # the diagonal alone gives no error feedback: exactly the weighted search
    w = weight.detach().float()
    if algorithm == "gptq":
        return fmt.gptq(w, hessian, seed=seed, fitted=fitted, compensated=compensated, act_order=act_order)
    if hessian is not None:
        importance = hessian.diagonal().contiguous()
    state, scale = fmt.search(w, importance, seed=seed, fitted=fitted)
    return fmt.pack_at_scale(w, state, scale)


def direct_cast(fmt: FormatBase, weight: torch.Tensor, *, algorithm: str,
                importance: torch.Tensor | None = None, hessian: torch.Tensor | None = None,
                seed: int = 0) -> torch.Tensor:
    """The decoded ``float32`` weight a packer writes for format ``fmt`` and ``algorithm``, bit for bit:
    ``fmt.unpack(pack(...), weight.shape)``. ``fmt.quantize`` stays the QAT forward (absmax)."""
    if fmt.layout is None:           # int8, bf16: no packed file; their one cast is the fake-quant forward
        check_weight(weight)
        if check_algorithm(algorithm) != "absmax":
            raise ValueError(f"algorithm {algorithm!r}: format {fmt.name!r} has only 'absmax'")
        return fmt.quantize(weight.detach().float(), fmt.fit(weight, seed=seed))
    tensors = pack(fmt, weight, algorithm=algorithm, importance=importance, hessian=hessian, seed=seed)
    return fmt.unpack(tensors, tuple(weight.shape))


# --- a start for QAT ---------------------------------------------------------------------------------

def cast(fmt: FormatBase, weight: torch.Tensor, *, algorithm: str,
         hessian: torch.Tensor | None = None, seed: int = 0,
         fitted: State | None = None, act_order: bool = GPTQ_ACT_ORDER) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The direct cast and the point QAT can start from, in one computation: ``(packed tensors, master)``, the
    tensors :func:`pack` writes and a float32 master weight such that quantising it at their state and scale
    gives those tensors' decoded weight bit for bit.

    The master is the continuous weight the algorithm rounded (the teacher's weight for a scale search; GPTQ's
    error-compensated weight), not the decoded one: a decoded weight sits at the centre of its quantisation cell,
    where the small steps of QAT never move it to another code. Where rounding makes a master's code differ from
    the cast's (an S3D8 byte: all three of its weights, ``fmt.whole_codes``), it starts at its decoded value."""
    w = weight.detach().float()
    compensated = torch.full_like(w, float("nan"))
    tensors = pack(fmt, w, algorithm=algorithm, hessian=hessian, seed=seed, fitted=fitted, compensated=compensated,
                   act_order=act_order)
    state, scale = fmt.state_of(tensors), tensors["scale"]
    decoded = fmt.unpack(tensors, tuple(w.shape))
    master = w if bool(compensated.isnan().all()) else compensated
    same = fmt.values_at_scale(master, state, scale) * fmt.expand_scale(scale.float(), w.shape) == decoded
    return tensors, torch.where(fmt.whole_codes(same), master, decoded)


def start(fmt: FormatBase, weight: torch.Tensor, *, algorithm: str,
          hessian: torch.Tensor | None = None, seed: int = 0, fitted: State | None = None,
          act_order: bool = GPTQ_ACT_ORDER) -> tuple[torch.Tensor, State, torch.Tensor]:
    """The post-training point of :func:`cast` as QAT takes it: ``(master weight, quantiser state, bf16 scale)``."""
    tensors, master = cast(fmt, weight, algorithm=algorithm, hessian=hessian, seed=seed, fitted=fitted,
                           act_order=act_order)
    return master, fmt.state_of(tensors), tensors["scale"]


# --- calibration ----------------------------------------------------------------------------------

def _run(model, batches) -> None:
    with torch.no_grad():
        for batch in batches:
            if isinstance(batch, dict):
                model(**batch)
            elif isinstance(batch, (tuple, list)):
                model(*batch)
            else:
                model(batch)


def _collect(model, batches, names, fn) -> dict[str, torch.Tensor]:
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if names is not None:
        missing = sorted(set(names) - set(linears))
        if missing:
            raise ValueError(f"names: not nn.Linear modules of the model: {missing[:5]}")
        linears = {n: linears[n] for n in names}
    return input_sums(lambda: _run(model, batches), linears, fn)


def input_sums(run, linears: dict[str, torch.nn.Linear], fn) -> dict[str, torch.Tensor]:
    """``sum fn(X) / n_rows`` (float32, summed in float64) of each Linear's inputs ``X`` (rows of ``d_in``) while
    ``run()`` runs, from forward pre-hooks; modules never called are absent. ``pipeline.cast.sequential`` takes each
    block's ``X^T X`` with it. Memory: the float64 sums, plus while one module's is updated its float64 input rows
    and ``fn`` of them (``calibrate.peak_bytes``)."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {n: 0 for n in linears}

    def hook(name):
        def pre(module, args):
            x = args[0].detach().reshape(-1, module.in_features).double()
            part = fn(x)
            sums[name] = part if name not in sums else sums[name].add_(part)      # in place: one sum each
            counts[name] += x.shape[0]
        return pre

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    # each float64 sum freed as its float32 mean is made: never all of both at once
    return {n: sums.pop(n).div_(counts[n]).float() for n in linears if counts[n]}


def collect_importance(model: torch.nn.Module, batches, names=None) -> dict[str, torch.Tensor]:
    """Per-input-channel importance ``diag(X^T X) / n_tokens`` (float32 ``[d_in]``) of every ``nn.Linear``
    (or those in ``names``), from forward pre-hooks while ``model`` runs each batch (a dict of keyword
    arguments, a tuple of positional ones, or one tensor). Every row of the input counts, padding included
    (mask it out of the batches to leave it out). Modules never called are absent."""
    return _collect(model, batches, names, lambda x: (x * x).sum(0))


def collect_hessians(model: torch.nn.Module, batches, names=None) -> dict[str, torch.Tensor]:
    """``X^T X / n_tokens`` (float32 ``[d_in, d_in]``) per ``nn.Linear``, for ``gptq`` (as
    :func:`collect_importance`; d_in^2 floats per module, so pass ``names`` for a large model)."""
    return _collect(model, batches, names, lambda x: x.T @ x)
