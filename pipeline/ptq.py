"""Post-training quantisation methods: how a weight is cast to a format without training.

Methods (``METHODS``), for every comparison format:

- ``absmax``: today's rule, the format's own ``fit`` and ``pack`` (absmax scales; for S3D8 the
  table fitted on absmax-normalised 3-vectors). Equal to ``formats.get(name).quantize`` bit for bit.
- ``search``: scale search. Each scale (S3D8: per row; 6-level formats: per block) is chosen to
  minimise the (importance-weighted) reconstruction error: a clipping grid ``alpha * absmax / qmax``
  (``ALPHAS``), then closed-form least-squares refinements given the codes,
  ``s = <w, t>_h / <t, t>_h``, each candidate kept only where it lowers the error. For S3D8 the three
  rows that share a byte are chosen jointly (a candidate is judged on the error of the whole 3-row
  group, since the codes of one row depend on the other two), and the centroid table is refitted by
  weighted k-means on the data normalised by the searched scales, alternating ``ROUNDS`` times; for
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

Every method returns the packed tensors a packer writes (:func:`pack`) and their decoded weight
(:func:`direct_cast`, equal to ``fmt.unpack(pack(...))`` bit for bit). Deterministic for a seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from pipeline.formats import s3d8, scalar
from pipeline.formats.base import ceil_div, check_weight
from pipeline.quant import INT8_MAX, channel_scale

Method = Literal["absmax", "search", "gptq"]
METHODS = get_args(Method)
DEFAULT_METHOD: Method = "gptq"
"""What ``method=None`` means: GPTQ on the calibration's ``X^T X`` (the scale search where a weight has none);
the toy world's measurement favours it (README "Results")."""


@dataclass
class PackParams:
    """The ``pack`` section of ``params.yaml``: read by direct-cast (the method) and pack-safetensors."""
    dtype: str = "bfloat16"               # of the tensors that are not quantised
    method: Method = DEFAULT_METHOD       # the direct cast's post-training method

ALPHAS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.6)   # clipping grid (least squares refines in between)
KAPPAS = (6.0, 5.0, 4.0, 3.5, 3.0)   # clipping at kappa x the row's RMS (S3D8: see s3d8_search_scales)
ROUNDS = 3                    # S3D8: (scale search, table refit) alternations
LS_STEPS = 2                  # least-squares scale refinements after each grid search
TINY = s3d8.SMALLEST_SCALE    # the scale of an all-zero row or block (smallest normal bf16)
KMEANS_VECTORS = 2 ** 18      # vectors a table refit uses at most (a seeded sample beyond)
GPTQ_BLOCK = 128
GPTQ_DAMP = 0.01


# --- argument checks ------------------------------------------------------------------------------

def check_method(method: str | None) -> str:
    method = DEFAULT_METHOD if method is None else method
    if method not in METHODS:
        raise ValueError(f"method: expected one of {', '.join(METHODS)} (or None for {DEFAULT_METHOD!r}), "
                         f"got {method!r}")
    return method


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


def _weights(importance: torch.Tensor | None, d_in: int) -> torch.Tensor:
    return torch.ones(d_in) if importance is None else importance


def _bf16_scale(value: torch.Tensor) -> torch.Tensor:
    """``bf16(max(value, TINY))`` (NaN -> TINY): a valid scale for any candidate value."""
    v = torch.nan_to_num(value.float(), nan=TINY, posinf=TINY, neginf=TINY).clamp(min=TINY)
    return v.to(torch.bfloat16)


# --- S3D8 -----------------------------------------------------------------------------------------

def _group_error(err_rows: torch.Tensor) -> torch.Tensor:
    """Per-row errors ``[d_out]`` summed over the 3-row byte groups ``[ceil(d_out/3)]`` (float64)."""
    e = err_rows.double()
    pad = (-e.numel()) % s3d8.GROUP
    return torch.nn.functional.pad(e, (0, pad)).view(-1, s3d8.GROUP).sum(1)


def _rows_of_groups(mask: torch.Tensor, d_out: int) -> torch.Tensor:
    return mask.repeat_interleave(s3d8.GROUP)[:d_out]


def _s3d8_row_errors(w: torch.Tensor, table: torch.Tensor, scale: torch.Tensor, h: torch.Tensor):
    """Decoded weight and weighted squared error per row for codes chosen at ``scale``."""
    q = s3d8.quantize_with_scale(w, table, scale)
    return q, ((w - q) ** 2 * h).sum(1)


def s3d8_search_scales(w: torch.Tensor, table: torch.Tensor, h: torch.Tensor,
                       start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row bf16 scales ``[d_out, 1]`` minimising each 3-row group's weighted error for ``table``
    (grid over ``ALPHAS`` with a common alpha per group, then ``LS_STEPS`` least-squares steps per row),
    and the group errors. ``start`` (e.g. the previous round's scales) is one more candidate."""
    d_out = w.shape[0]
    absmax = w.abs().amax(1, keepdim=True)
    best_scale, best = None, None
    candidates = [_bf16_scale(a * absmax / INT8_MAX) for a in ALPHAS]
    # a clip at kappa weighted-RMS of the row: one kappa per group clips an outlier row hard and leaves its
    # Gaussian neighbours (absmax ~ 3-4 RMS) alone, which no common fraction of absmax can do
    rms = ((w * w * h).sum(1, keepdim=True) / h.sum().clamp(min=1e-30)).sqrt()
    candidates += [_bf16_scale(torch.minimum(absmax, k * rms) / INT8_MAX) for k in KAPPAS]
    if start is not None:
        candidates.append(start)
    for step in range(1 + LS_STEPS):
        for cand in candidates:
            _, err = _s3d8_row_errors(w, table, cand, h)
            g = _group_error(err)
            if best is None:
                best_scale, best = cand.clone(), g
                continue
            better = _rows_of_groups(g < best, d_out)
            best_scale = torch.where(better[:, None], cand, best_scale)
            best = torch.minimum(best, g)
        if step == LS_STEPS:
            break
        # least squares given the codes at the current best scales: s = <w, t>_h / <t, t>_h per row
        q, _ = _s3d8_row_errors(w, table, best_scale, h)
        t = q / best_scale.float()          # the signed table values (exact: q = t * scale)
        num, den = (w * t * h).sum(1, keepdim=True), (t * t * h).sum(1, keepdim=True)
        ls = torch.where((den > 0) & (num > 0), num / den.clamp(min=1e-30), best_scale.float())
        candidates = [_bf16_scale(ls)]
    return best_scale, best


def _normalised_sample(w: torch.Tensor, scale: torch.Tensor, h: torch.Tensor, max_vectors: int, seed: int):
    """Absolute normalised 3-vectors ``[N, 3]`` (float32) and their weights ``h[column]`` (a seeded
    sample of at most ``max_vectors``; the padding rows count as zeros, padding columns are left out)."""
    d_out, d_in = w.shape
    n_groups = ceil_div(d_out, s3d8.GROUP)
    total = n_groups * d_in
    if total <= max_vectors:
        index = torch.arange(total)
    else:
        index = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:max_vectors].sort().values
    g, k = index // d_in, index % d_in
    cols = []
    for j in range(s3d8.GROUP):
        rows = g * s3d8.GROUP + j
        valid = rows < d_out
        rows = rows.clamp(max=d_out - 1)
        vals = w[rows, k] / scale[rows, 0].float()
        cols.append(torch.where(valid, vals, torch.zeros_like(vals)).abs())
    return torch.stack(cols, 1), h[k].double()


def refit_table(w: torch.Tensor, scale: torch.Tensor, h: torch.Tensor, table: torch.Tensor, *, seed: int = 0,
                max_vectors: int = KMEANS_VECTORS, tol: float = 1e-3, max_iter: int = 15) -> torch.Tensor:
    """Weighted Lloyd-Max (k-means) of the table on ``|W / scale|``, warm-started from ``table``;
    a vector in column k weighs ``h[k]``. Rounded and clamped to the int8 table's [0, 127]."""
    a, wt = _normalised_sample(w, scale, h, max_vectors, seed)
    a64, a_t = a.double(), a.T.contiguous()
    c = table.double().clone()
    assign = None
    for _ in range(max_iter):
        new = s3d8._nearest_columns(a_t, c.float())
        changed = a.shape[0] if assign is None else int((new != assign).sum())
        assign = new
        mass = torch.zeros(s3d8.N_CENTROIDS, dtype=torch.float64).index_add_(0, assign, wt)
        sums = torch.zeros(s3d8.N_CENTROIDS, s3d8.GROUP, dtype=torch.float64).index_add_(0, assign, a64 * wt[:, None])
        filled = mass > 0
        c[filled] = sums[filled] / mass[filled, None]
        if changed <= tol * a.shape[0]:
            break
    return c.round().clamp(0, 127).to(torch.int8)


def s3d8_search(weight: torch.Tensor, importance: torch.Tensor | None = None, *, seed: int = 0,
                rounds: int = ROUNDS, table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``search`` method for S3D8: ``(table int8 [32, 3], scale bf16 [d_out, 1])``. ``table``: the
    absmax table ``fit_centroids(weight, seed=seed)`` when already at hand (it is fitted otherwise)."""
    w = weight.detach().float()
    h = _weights(importance, w.shape[1])
    table = s3d8.fit_centroids(weight, seed=seed) if table is None else s3d8.check_table(table)
    absmax_scale = s3d8.weight_scale(w)
    _, err = _s3d8_row_errors(w, table, absmax_scale, h)
    best = (float(err.double().sum()), table, absmax_scale)
    scale = None
    for r in range(rounds):
        scale, g = s3d8_search_scales(w, table, h, start=scale)
        total = float(g.sum())
        if total < best[0]:
            best = (total, table, scale)
        if r + 1 < rounds:
            table = refit_table(w, scale, h, table, seed=seed)
    return best[1], best[2]


def gptq(weight: torch.Tensor, hessian: torch.Tensor, quant_col, *, block: int = GPTQ_BLOCK,
         damp: float = GPTQ_DAMP) -> torch.Tensor:
    """GPTQ error feedback (Frantar et al. 2022, lazy block updates): columns in order, each quantised
    by ``quant_col(k, column) -> quantised column`` and its error spread over the later columns through
    the upper Cholesky factor of ``H^-1`` (``H`` damped by ``damp * mean(diag H)``). Input channels that
    never carry signal (``H[k, k] == 0``) are set to zero first. Returns the quantised weight."""
    w = weight.detach().float().clone()
    h = hessian.detach().double().clone()
    d_in = w.shape[1]
    dead = h.diagonal() == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * h.diagonal().mean() * torch.eye(d_in, dtype=torch.float64)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    q = torch.zeros_like(w)
    for i1 in range(0, d_in, block):
        i2 = min(i1 + block, d_in)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = w1[:, i]
            qc = quant_col(i1 + i, col)
            q[:, i1 + i] = qc
            e = (col - qc) / u1[i, i]
            w1[:, i:] -= e[:, None] * u1[i, i:][None, :]
            err1[:, i] = e
        w[:, i2:] -= err1 @ u[i1:i2, i2:]
    return q


def s3d8_gptq(weight: torch.Tensor, hessian: torch.Tensor, *, seed: int = 0, start=None,
              compensated: torch.Tensor | None = None):
    """The ``gptq`` method for S3D8: ``(packed, scale bf16 [d_out, 1], table)``. ``start``: the
    ``(table, scale)`` of ``s3d8_search(weight, diag(hessian), seed=seed)`` when already at hand.
    ``compensated`` (float32 ``[d_out, d_in]``) receives the error-compensated weights GPTQ quantised, rescaled
    with the refitted row scales (so their nearest codes are the result's, up to rounding)."""
    w = weight.detach().float()
    d_out, d_in = w.shape
    table, scale = s3d8_search(w, hessian.diagonal(), seed=seed) if start is None else start
    n_groups, d_in_padded = s3d8.packed_shape(w.shape)
    t = table.float()
    sf = torch.ones(n_groups * s3d8.GROUP)
    sf[:d_out] = scale.float().reshape(-1)
    codes = torch.empty(n_groups, d_in_padded, dtype=torch.int64)
    signs = torch.zeros(n_groups, d_in_padded, s3d8.GROUP, dtype=torch.bool)
    # padding columns hold zeros, as encode() writes them
    codes[:, d_in:] = s3d8.nearest_centroid(torch.zeros(1, s3d8.GROUP), table)[0]

    def quant_col(k: int, col: torch.Tensor) -> torch.Tensor:
        v = torch.zeros(n_groups * s3d8.GROUP)
        v[:d_out] = col
        v = (v / sf).view(n_groups, s3d8.GROUP)
        q = s3d8._nearest_columns(v.abs().T.contiguous(), table)
        neg = v < 0
        codes[:, k], signs[:, k] = q, neg
        if compensated is not None:
            compensated[:, k] = col
        mag = t[q]
        return (torch.where(neg & (mag != 0), -mag, mag).reshape(-1) * sf)[:d_out]

    gptq(w, hessian, quant_col)
    packed = s3d8.pack_codes(codes, signs)
    # refit each row's scale for the output error, codes kept: s = (w H t) / (t H t)
    ti = s3d8.decode_int8(packed, table, (d_out, d_in)).double()
    hd = hessian.double()
    num, den = ((w.double() @ hd) * ti).sum(1), ((ti @ hd) * ti).sum(1)
    cur = scale.double().reshape(-1)
    new = _bf16_scale(torch.where(den > 0, num / den.clamp(min=1e-300), cur)).double().reshape(-1)
    err = lambda s: s * s * den - 2 * s * num       # noqa: E731 (the constant w H w^T left out)
    scale = torch.where((err(new) < err(cur))[:, None], new.to(torch.bfloat16)[:, None], scale)
    if compensated is not None:
        compensated.mul_(scale.float() / cur.float()[:, None])
    return packed, scale, table


# --- the 6-level formats --------------------------------------------------------------------------

def _scalar_parts(fmt, weight: torch.Tensor, h: torch.Tensor):
    w = scalar.blocked(weight.detach().float(), fmt.block)                       # [d_out, nb, B]
    hb = scalar.blocked(h[None, :], fmt.block)[0]                                # [nb, B], padding 0
    return w, hb


def scalar_codes(w_blocked: torch.Tensor, codepoints: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Nearest code per weight for given block scales (bf16 ``[d_out, nb]``), as ``scalar.encode``."""
    return scalar.nearest_code(w_blocked / scale.float()[..., None], codepoints)


def scalar_pack_codes(codes: torch.Tensor, d_out: int, d_in: int) -> torch.Tensor:
    """Codes ``[d_out, nb, B]`` (or ``[d_out, d_in]``) to the base-6 bytes of ``scalar.encode``."""
    flat = codes.reshape(d_out, -1)[:, :d_in].reshape(-1)
    flat = torch.nn.functional.pad(flat, (0, (-flat.numel()) % 3)).view(-1, 3)
    return (flat[:, 0] + 6 * flat[:, 1] + 36 * flat[:, 2]).to(torch.uint8)


def scalar_search(fmt, weight: torch.Tensor, importance: torch.Tensor | None = None, *, seed: int = 0,
                  rounds: int = ROUNDS, codepoints: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``search`` method for a 6-level format: ``(codepoints, scale bf16 [d_out, n_blocks])``.
    ``codepoints``: ``fmt.fit(weight, seed=seed)``'s when already at hand (fitted otherwise).

    Per block: the clipping grid, then least squares, each block keeping its best candidate; lloyd-max
    (``block is None``, code points fitted to the data) also refits its code points, weighted, on the
    searched normalisation, alternating ``rounds`` times."""
    w, hb = _scalar_parts(fmt, weight, _weights(importance, weight.shape[1]))
    codepoints = (fmt.fit(weight, seed=seed)["codepoints"] if codepoints is None else codepoints).float()
    absmax = w.abs().amax(-1)

    def block_err(cp, scale):
        c = scalar_codes(w, cp, scale)
        return ((w - cp[c] * scale.float()[..., None]) ** 2 * hb).sum(-1), c

    base_scale = channel_scale(w, fmt.qmax).squeeze(-1)
    e0, _ = block_err(codepoints, base_scale)
    best_total = (float(e0.double().sum()), codepoints, base_scale)
    refit = fmt.name == "lloyd_max"
    scale = None
    for r in range(rounds if refit else 1):
        candidates = [_bf16_scale(a * absmax / fmt.qmax) for a in ALPHAS] + ([scale] if scale is not None else [])
        best_s, best_e = None, None
        for step in range(1 + LS_STEPS):
            for cand in candidates:
                e, _ = block_err(codepoints, cand)
                if best_e is None:
                    best_s, best_e = cand.clone(), e
                    continue
                better = e < best_e
                best_s = torch.where(better, cand, best_s)
                best_e = torch.minimum(best_e, e)
            if step == LS_STEPS:
                break
            _, c = block_err(codepoints, best_s)
            t = codepoints[c]
            num, den = (w * t * hb).sum(-1), (t * t * hb).sum(-1)
            candidates = [_bf16_scale(torch.where((den > 0) & (num > 0), num / den.clamp(min=1e-30), best_s.float()))]
        scale = best_s
        total = float(best_e.double().sum())
        if total < best_total[0]:
            best_total = (total, codepoints, scale)
        if refit and r + 1 < rounds:
            u = (w / scale.float()[..., None]).reshape(-1)
            wt = hb.expand_as(w).reshape(-1)
            keep = wt > 0
            u, wt = u[keep], wt[keep]
            if u.numel() > KMEANS_VECTORS:
                idx = torch.randperm(u.numel(), generator=torch.Generator().manual_seed(seed))[:KMEANS_VECTORS]
                u, wt = u[idx], wt[idx]
            codepoints = scalar.lloyd_max_1d(u, wt)
    return best_total[1], best_total[2]


def scalar_gptq(fmt, weight: torch.Tensor, hessian: torch.Tensor, *, seed: int = 0, start=None,
                compensated: torch.Tensor | None = None):
    """The ``gptq`` method for a 6-level format: ``(codes uint8, scale, codepoints)``. ``start``: the
    ``(codepoints, scale)`` of ``scalar_search(fmt, weight, diag(hessian), seed=seed)`` when at hand.
    ``compensated`` receives the error-compensated weights GPTQ quantised."""
    w = weight.detach().float()
    d_out, d_in = w.shape
    codepoints, scale = scalar_search(fmt, w, hessian.diagonal(), seed=seed) if start is None else start
    block = fmt.block or d_in
    sf = scale.float()
    codes = torch.zeros(d_out, d_in, dtype=torch.int64)

    def quant_col(k: int, col: torch.Tensor) -> torch.Tensor:
        s = sf[:, k // block]
        c = scalar.nearest_code(col / s, codepoints)
        codes[:, k] = c
        if compensated is not None:
            compensated[:, k] = col
        return codepoints[c] * s

    gptq(w, hessian, quant_col)
    return scalar_pack_codes(codes, d_out, d_in), scale, codepoints


# --- the contract -----------------------------------------------------------------------------------

def pack(name: str, weight: torch.Tensor, *, method: str | None = None, importance: torch.Tensor | None = None,
         hessian: torch.Tensor | None = None, seed: int = 0, fitted: dict[str, torch.Tensor] | None = None,
         compensated: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The packed tensors (``{suffix: tensor}``, as ``formats.get(name).pack`` lays them out) of ``weight``
    cast to format ``name`` by ``method`` (None: ``DEFAULT_METHOD``; ``absmax``, the only one, for the formats
    outside the comparison: int8, bf16). What a packer writes. ``fitted``: the format's ``fit(weight, seed)``
    when already at hand (stage fit-centroids' state of this weight), which every method starts from; fitted here
    otherwise. ``compensated`` (float32 ``[d_out, d_in]``, for :func:`cast`) receives GPTQ's error-compensated
    weights when the method runs GPTQ, else stays untouched."""
    from pipeline import formats

    fmt = formats.get(name)
    check_weight(weight)
    method = check_method("absmax" if method is None and not fmt.comparison else method)
    d_out, d_in = weight.shape
    importance = check_importance(importance, d_in)
    hessian = check_hessian(hessian, d_in)
    if hessian is not None and importance is not None:
        raise ValueError("importance and hessian: give one (the hessian's diagonal is the importance)")
    if method == "absmax" or not fmt.comparison:
        if method != "absmax":
            raise ValueError(f"method {method!r}: format {name!r} has only 'absmax'")
        return fmt.pack(weight.detach(), fmt.fit(weight, seed=seed) if fitted is None else fitted)
    if method == "gptq" and hessian is None:
        method = "search"          # the diagonal alone gives no error feedback: exactly the weighted search
    if hessian is not None and method == "search":
        importance = hessian.diagonal().contiguous()
    w = weight.detach().float()
    if fmt.name == s3d8.NAME:
        table = None if fitted is None else fitted["table"]
        if method == "gptq":
            start = s3d8_search(w, hessian.diagonal(), seed=seed, table=table)
            packed, scale, table = s3d8_gptq(w, hessian, seed=seed, start=start, compensated=compensated)
            return {"packed": packed.reshape(-1), "scale": scale, "table": table}
        table, scale = s3d8_search(w, importance, seed=seed, table=table)
        return pack_at_scale(name, w, {"table": table}, scale)
    codepoints = None if fitted is None else fitted["codepoints"]
    if method == "gptq":
        start = scalar_search(fmt, w, hessian.diagonal(), seed=seed, codepoints=codepoints)
        codes, scale, codepoints = scalar_gptq(fmt, w, hessian, seed=seed, start=start, compensated=compensated)
        return {"codes": codes, "scale": scale, "codepoints": codepoints}
    codepoints, scale = scalar_search(fmt, w, importance, seed=seed, codepoints=codepoints)
    return pack_at_scale(name, w, {"codepoints": codepoints}, scale)


def direct_cast(name: str, weight: torch.Tensor, *, method: str | None = None,
                importance: torch.Tensor | None = None, hessian: torch.Tensor | None = None,
                seed: int = 0) -> torch.Tensor:
    """The decoded ``float32`` weight a packer writes for format ``name`` and ``method``, bit for bit:
    ``formats.get(name).unpack(pack(...), weight.shape)``."""
    from pipeline import formats

    fmt = formats.get(name)
    if fmt.layout is None:           # int8, bf16: no packed file; their one cast is the fake-quant forward
        check_weight(weight)
        if check_method("absmax" if method is None else method) != "absmax":
            raise ValueError(f"method {method!r}: format {name!r} has only 'absmax'")
        return fmt.quantize(weight.detach().float(), fmt.fit(weight, seed=seed))
    tensors = pack(name, weight, method=method, importance=importance, hessian=hessian, seed=seed)
    return fmt.unpack(tensors, tuple(weight.shape))


# --- given scales: a start for QAT, and the QAT student's learned scales -----------------------------

def state_of(name: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The quantiser state (``{"table"}`` for S3D8, ``{"codepoints"}`` for a 6-level format) that packed
    ``tensors`` were written with."""
    key = "table" if name == s3d8.NAME else "codepoints"
    return {key: tensors[key]}


def absmax_scale(name: str, weight: torch.Tensor) -> torch.Tensor:
    """The bf16 scale the format's own ``quantize`` derives from ``weight`` (S3D8: per row ``[d_out, 1]``;
    a 6-level format: per block ``[d_out, n_blocks]``)."""
    from pipeline import formats

    if name == s3d8.NAME:
        return s3d8.weight_scale(weight)
    fmt = formats.get(name)
    return scalar.block_scales(weight, fmt.block, fmt.qmax)


def expand_scale(name: str, scale: torch.Tensor, shape) -> torch.Tensor:
    """``scale`` (as :func:`absmax_scale` lays it out) broadcast to one value per weight, ``[d_out, d_in]``."""
    from pipeline import formats

    d_out, d_in = shape
    if name == s3d8.NAME:
        return scale.reshape(d_out, 1).expand(d_out, d_in)
    block = formats.get(name).block or d_in
    return scale.repeat_interleave(block, dim=1)[:, :d_in]


def pack_at_scale(name: str, weight: torch.Tensor, state: dict[str, torch.Tensor],
                  scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """The packed tensors of ``weight`` in format ``name`` with the given quantiser ``state`` and bf16
    ``scale`` (codes: nearest centroid / code point of the weight over its scale, no clamping), as a packer
    writes them for the QAT student with learned scales."""
    from pipeline import formats

    fmt = formats.get(name)
    check_weight(weight)
    w = weight.detach().float()
    if name == s3d8.NAME:
        packed, scale = s3d8.encode_auto(w, state["table"], s3d8.check_scale(scale, w.shape[0]))
        return {"packed": packed.reshape(-1), "scale": scale, "table": s3d8.check_table(state["table"])}
    d_out, d_in = w.shape
    cp = state["codepoints"].float()
    scale = scale.detach().to(torch.bfloat16)
    codes = scalar_codes(scalar.blocked(w, fmt.block), cp, scale)
    return {"codes": scalar_pack_codes(codes, d_out, d_in), "scale": scale, "codepoints": cp}


def values_at_scale(name: str, weight: torch.Tensor, state: dict[str, torch.Tensor],
                    scale: torch.Tensor) -> torch.Tensor:
    """``unpack(pack_at_scale(...)) / scale``: each weight's code value in units of its scale, float32
    ``[d_out, d_in]`` (S3D8: the signed table entries; a 6-level format: its code points). Times
    ``expand_scale(scale)`` it is the decoded weight, bit for bit."""
    w = weight.detach().float()
    if name == s3d8.NAME:
        packed = pack_at_scale(name, w, state, scale)["packed"]
        return s3d8.decode_int8_auto(packed, state["table"], tuple(w.shape)).float()
    from pipeline import formats

    d_out, d_in = w.shape
    cp = state["codepoints"].float().to(w.device)
    codes = scalar_codes(scalar.blocked(w, formats.get(name).block), cp, scale.detach().to(torch.bfloat16))
    return cp[codes].reshape(d_out, -1)[:, :d_in]


def cast(name: str, weight: torch.Tensor, *, method: str | None = None, hessian: torch.Tensor | None = None,
         seed: int = 0, fitted: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The direct cast and the point QAT can start from, in one computation: ``(packed tensors, master)``, the
    tensors :func:`pack` writes and a float32 master weight such that quantising it at their state and scale
    gives those tensors' decoded weight bit for bit.

    The master is the continuous weight the method rounded (the teacher's weight for a scale search; GPTQ's
    error-compensated weight), not the decoded one: a decoded weight sits at the centre of its quantisation cell,
    where the small steps of QAT never move it to another code. Where rounding makes a master's code differ from
    the cast's (an S3D8 byte: all three of its weights), it starts at its decoded value."""
    from pipeline import formats

    fmt = formats.get(name)
    w = weight.detach().float()
    compensated = torch.full_like(w, float("nan"))
    tensors = pack(name, w, method=method, hessian=hessian, seed=seed, fitted=fitted, compensated=compensated)
    state, scale = state_of(name, tensors), tensors["scale"]
    decoded = fmt.unpack(tensors, tuple(w.shape))
    master = w if bool(compensated.isnan().all()) else compensated
    same = values_at_scale(name, master, state, scale) * expand_scale(name, scale.float(), w.shape) == decoded
    if name == s3d8.NAME:          # a byte's three weights share their code: all of them or none
        rows = ceil_div(w.shape[0], s3d8.GROUP) * s3d8.GROUP
        groups = torch.nn.functional.pad(same, (0, 0, 0, rows - w.shape[0]), value=True)
        same = groups.view(-1, s3d8.GROUP, w.shape[1]).all(1).repeat_interleave(s3d8.GROUP, 0)[:w.shape[0]]
    return tensors, torch.where(same, master, decoded)


def start(name: str, weight: torch.Tensor, *, method: str | None = None, hessian: torch.Tensor | None = None,
          seed: int = 0, fitted: dict[str, torch.Tensor] | None = None
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """The post-training point of :func:`cast` as QAT takes it: ``(master weight, quantiser state, bf16 scale)``."""
    tensors, master = cast(name, weight, method=method, hessian=hessian, seed=seed, fitted=fitted)
    return master, state_of(name, tensors), tensors["scale"]


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
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {n: 0 for n in linears}

    def hook(name):
        def pre(module, args):
            x = args[0].detach().reshape(-1, module.in_features).double()
            part = fn(x)
            sums[name] = part if name not in sums else sums[name] + part
            counts[name] += x.shape[0]
        return pre

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    try:
        _run(model, batches)
    finally:
        for handle in handles:
            handle.remove()
    return {n: (sums[n] / counts[n]).float() for n in linears if counts[n]}


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
