"""The mechanism the 6-level formats of the paper's comparison share (SPEC section 3): one code point per
weight. The formats themselves are ``int.py``, ``student_t.py`` and ``lloyd_max.py``.

A bf16 absmax scale per block of the input dimension (a 128-wide block, or the whole row for a channel
scale), then the nearest of 6 sorted code points (ties go to the lower code point). What differs is where
the code points come from: ``int`` uses the integers {-3, ..., 2}, ``student_t`` fits them to a Student-t
distribution, ``lloyd_max`` runs 1-D Lloyd-Max on the normalised weights.

Storage (a layout of ours, not the paper's): 3 codes per byte in base 6, row-major, padded to a whole
byte; bf16 scales; float32 code points. ``bits_per_param`` counts ``log2(6)`` per weight as the
paper does, ``storage_bytes`` the 8/3 bits per weight a byte-aligned file really takes.
"""

from __future__ import annotations

import math

import torch

from pipeline.formats import numerics
from pipeline.formats.base import LOG2_6, FormatBase, PackedSpecs, State, ceil_div, check_shape, check_weight
from pipeline.quant import channel_scale, straight_through

N_LEVELS = 6
BLOCK = 128


def block_scales(weight: torch.Tensor, block: int | None, qmax: float) -> torch.Tensor:
    """bf16 absmax/qmax scale per ``block``-wide slice of each row (``None``: the whole row),
    shape ``[d_out, n_blocks]``."""
    w = blocked(weight.detach(), block)
    return channel_scale(w, qmax).squeeze(-1)


def blocked(weight: torch.Tensor, block: int | None) -> torch.Tensor:
    d_out, d_in = weight.shape
    block = d_in if block is None else block
    n_blocks = ceil_div(d_in, block)
    w = weight.float()
    if n_blocks * block != d_in:
        w = torch.nn.functional.pad(w, (0, n_blocks * block - d_in))
    return w.view(d_out, n_blocks, block)


def nearest_code(u: torch.Tensor, codepoints: torch.Tensor) -> torch.Tensor:
    """Index of the nearest code point (sorted ascending; a tie goes to the lower one)."""
    mid = (codepoints[1:] + codepoints[:-1]) / 2
    return torch.bucketize(u, mid.to(u.device), right=False)


def _codes_and_scales(weight: torch.Tensor, codepoints: torch.Tensor, block: int | None,
                      qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Code index per weight ``[d_out, n_blocks, block]`` (padding included) and bf16 scales."""
    w = blocked(weight.detach(), block)
    scale = channel_scale(w, qmax)
    return nearest_code(w / scale.float(), codepoints.to(w.device)), scale


def quantize_scalar(weight: torch.Tensor, codepoints: torch.Tensor, block: int | None,
                    qmax: float) -> torch.Tensor:
    """Fake-quantise with a block scale and a sorted code book; straight-through gradient.

    Equal bit for bit to ``decode(*encode(...))`` for float32 input."""
    check_weight(weight)
    codepoints = check_codepoints(codepoints).to(weight.device)
    d_out, d_in = weight.shape
    codes, scale = _codes_and_scales(weight, codepoints, block, qmax)
    q = (codepoints[codes] * scale.float()).reshape(d_out, -1)[:, :d_in]
    return straight_through(weight, q.to(weight.dtype))


def encode(weight: torch.Tensor, codepoints: torch.Tensor, block: int | None,
           qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack: ``(codes uint8 [ceil(d_out * d_in / 3)], scale bf16 [d_out, n_blocks])``.

    Codes run row-major over the logical weight, three to a byte as ``c0 + 6 c1 + 36 c2``; the last
    byte is padded with code 0."""
    check_weight(weight)
    codepoints = check_codepoints(codepoints)
    d_out, d_in = weight.shape
    codes, scale = _codes_and_scales(weight, codepoints, block, qmax)
    flat = codes.reshape(d_out, -1)[:, :d_in].reshape(-1)
    flat = torch.nn.functional.pad(flat, (0, (-flat.numel()) % 3)).view(-1, 3)
    packed = flat[:, 0] + 6 * flat[:, 1] + 36 * flat[:, 2]
    return packed.to(torch.uint8), scale.squeeze(-1)


def decode(packed: torch.Tensor, scale: torch.Tensor, codepoints: torch.Tensor, block: int | None,
           shape) -> torch.Tensor:
    """Unpack to ``float32 [d_out, d_in]``: code point times its block scale."""
    d_out, d_in = check_shape(shape)
    codepoints = check_codepoints(codepoints)
    n_blocks = ceil_div(d_in, block or d_in)
    if packed.dtype != torch.uint8 or packed.numel() != ceil_div(d_out * d_in, 3):
        raise ValueError(f"codes: a weight of shape {(d_out, d_in)} needs {ceil_div(d_out * d_in, 3)} "
                         f"uint8 bytes, got {packed.numel()} of {packed.dtype}")
    if int(packed.max()) >= N_LEVELS ** 3:
        raise ValueError(f"codes: byte values must be below {N_LEVELS ** 3}, got {int(packed.max())}")
    if scale.numel() != d_out * n_blocks:
        raise ValueError(f"scale: expected {d_out} x {n_blocks} block scales, got {list(scale.shape)}")
    b = packed.reshape(-1).long()
    codes = torch.stack([b % 6, (b // 6) % 6, b // 36], dim=1).reshape(-1)[:d_out * d_in]
    values = codepoints[codes].view(d_out, d_in)
    per_weight = scale.reshape(d_out, n_blocks).float().repeat_interleave(block or d_in, dim=1)[:, :d_in]
    return values * per_weight


def check_codepoints(codepoints: torch.Tensor) -> torch.Tensor:
    if not isinstance(codepoints, torch.Tensor) or codepoints.shape != (N_LEVELS,):
        raise ValueError(f"codepoints: expected a tensor of {N_LEVELS} values, got "
                         f"{list(codepoints.shape) if isinstance(codepoints, torch.Tensor) else codepoints!r}")
    if not codepoints.is_floating_point() or not torch.isfinite(codepoints).all():
        raise ValueError(f"codepoints: expected finite floats, got {codepoints.tolist()}")
    if not bool((codepoints[1:] > codepoints[:-1]).all()):
        raise ValueError(f"codepoints: must be strictly increasing, got {codepoints.tolist()}")
    return codepoints.float()


def subsample(values: torch.Tensor, max_values: int, seed: int) -> torch.Tensor:
    values = values.reshape(-1)
    if values.numel() <= max_values:
        return values
    gen = torch.Generator().manual_seed(seed)
    return values[torch.randint(values.numel(), (max_values,), generator=gen, device=gen.device).to(values.device)]


def lloyd_max_1d(values: torch.Tensor, weights: torch.Tensor | None = None, *, levels: int = N_LEVELS,
                 tol: float = 1e-3, max_iter: int = 200) -> torch.Tensor:
    """Lloyd-Max (1-D k-means) code points for ``values`` (optionally weighted), from quantile init."""
    v = values.double().reshape(-1)
    wts = torch.ones_like(v) if weights is None else weights.double().reshape(-1)
    order = torch.argsort(v)
    v, wts = v[order], wts[order]
    cdf = torch.cumsum(wts, 0) / wts.sum()
    targets = (torch.arange(levels, dtype=torch.float64, device=v.device) + 0.5) / levels
    code = v[torch.searchsorted(cdf, targets).clamp(max=v.numel() - 1)]
    assign = None
    for _ in range(max_iter):
        code = torch.sort(code).values
        new = torch.bucketize(v, (code[1:] + code[:-1]) / 2)
        changed = v.numel() if assign is None else int((new != assign).sum())
        assign = new
        mass = torch.zeros(levels, dtype=torch.float64, device=v.device).index_add_(0, new, wts)
        total = torch.zeros(levels, dtype=torch.float64, device=v.device).index_add_(0, new, wts * v)
        filled = mass > 0
        code[filled] = total[filled] / mass[filled]
        if changed <= tol * v.numel():
            break
    code = torch.sort(code).values.float()
    # Keep code points distinct so the nearest-code rule stays well defined.
    for i in range(1, levels):
        if code[i] <= code[i - 1]:
            code[i] = torch.nextafter(code[i - 1], torch.tensor(math.inf, device=code.device))
    return code


# --- post-training methods (``pipeline.cast.ptq`` chooses one): the scale search and GPTQ's grouping ------------

def _parts(fmt, weight: torch.Tensor, h: torch.Tensor):
    w = blocked(weight.detach().float(), fmt.block)                       # [d_out, nb, B]
    hb = blocked(h[None, :], fmt.block)[0]                                # [nb, B], padding 0
    return w, hb


def codes_at_scale(w_blocked: torch.Tensor, codepoints: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Nearest code per weight for given block scales (bf16 ``[d_out, nb]``), as ``encode``."""
    return nearest_code(w_blocked / scale.float()[..., None], codepoints)


def pack_codes(codes: torch.Tensor, d_out: int, d_in: int) -> torch.Tensor:
    """Codes ``[d_out, nb, B]`` (or ``[d_out, d_in]``) to the base-6 bytes of ``encode``."""
    flat = codes.reshape(d_out, -1)[:, :d_in].reshape(-1)
    flat = torch.nn.functional.pad(flat, (0, (-flat.numel()) % 3)).view(-1, 3)
    return (flat[:, 0] + 6 * flat[:, 1] + 36 * flat[:, 2]).to(torch.uint8)


def search(fmt, weight: torch.Tensor, importance: torch.Tensor | None = None, *, seed: int = 0,
           rounds: int = numerics.ROUNDS,
           codepoints: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``search`` method for a 6-level format: ``(codepoints, scale bf16 [d_out, n_blocks])``.
    ``codepoints``: ``fmt.fit(weight, seed=seed)``'s when already at hand (fitted otherwise).

    Per block: the clipping grid, then least squares, each block keeping its best candidate; lloyd-max
    (``block is None``, code points fitted to the data) also refits its code points, weighted, on the
    searched normalisation, alternating ``rounds`` times."""
    w, hb = _parts(fmt, weight, numerics.weights(importance, weight))
    codepoints = (fmt.fit(weight, seed=seed)["codepoints"] if codepoints is None else codepoints).float()
    absmax = w.abs().amax(-1)

    def block_err(cp, scale):
        c = codes_at_scale(w, cp, scale)
        return ((w - cp[c] * scale.float()[..., None]) ** 2 * hb).sum(-1), c

    base_scale = channel_scale(w, fmt.qmax).squeeze(-1)
    e0, _ = block_err(codepoints, base_scale)
    best_total = (float(e0.double().sum()), codepoints, base_scale)
    refit = fmt.refit_codepoints
    scale = None
    for r in range(rounds if refit else 1):
        candidates = [numerics.bf16_scale(a * absmax / fmt.qmax) for a in numerics.ALPHAS]
        candidates += [scale] if scale is not None else []
        best_s, best_e = None, None
        for step in range(1 + numerics.LS_STEPS):
            for cand in candidates:
                e, _ = block_err(codepoints, cand)
                if best_e is None:
                    best_s, best_e = cand.clone(), e
                    continue
                better = e < best_e
                best_s = torch.where(better, cand, best_s)
                best_e = torch.minimum(best_e, e)
            if step == numerics.LS_STEPS:
                break
            _, c = block_err(codepoints, best_s)
            t = codepoints[c]
            candidates = [numerics.least_squares_scale(w, t, hb, best_s)]
        scale = best_s
        total = float(best_e.double().sum())
        if total < best_total[0]:
            best_total = (total, codepoints, scale)
        if refit and r + 1 < rounds:
            u = (w / scale.float()[..., None]).reshape(-1)
            wt = hb.expand_as(w).reshape(-1)
            keep = wt > 0
            u, wt = u[keep], wt[keep]
            if u.numel() > numerics.KMEANS_VECTORS:
                gen = torch.Generator().manual_seed(seed)
                idx = torch.randperm(u.numel(), generator=gen, device=gen.device)[:numerics.KMEANS_VECTORS]
                u, wt = u[idx.to(u.device)], wt[idx.to(u.device)]
            codepoints = lloyd_max_1d(u, wt)
    return best_total[1], best_total[2]


def gptq_pack(fmt, weight: torch.Tensor, hessian: torch.Tensor, *, seed: int = 0, start=None,
              compensated: torch.Tensor | None = None, act_order: bool = numerics.GPTQ_ACT_ORDER):
    """The ``gptq`` method for a 6-level format: ``(codes uint8, scale, codepoints)``. ``start``: the
    ``(codepoints, scale)`` of ``search(fmt, weight, diag(hessian), seed=seed)`` when at hand.
    ``compensated`` receives the error-compensated weights GPTQ quantised; ``act_order`` as ``numerics.gptq``
    (the block scales are the search's, fixed before it: GPTQ's ``static_groups``)."""
    w = weight.detach().float()
    d_out, d_in = w.shape
    codepoints, scale = search(fmt, w, hessian.diagonal(), seed=seed) if start is None else start
    block = fmt.block or d_in
    sf = scale.float()
    codes = torch.zeros(d_out, d_in, dtype=torch.int64, device=w.device)

    def quant_col(k: int, col: torch.Tensor) -> torch.Tensor:
        s = sf[:, k // block]
        c = nearest_code(col / s, codepoints)
        codes[:, k] = c
        if compensated is not None:
            compensated[:, k] = col
        return codepoints[c] * s

    numerics.gptq(w, hessian, quant_col, act_order=act_order)
    return pack_codes(codes, d_out, d_in), scale, codepoints


LAYOUT = "s3d8-pipeline-scalar6-v1"
"""Our packed layout of the 6-level formats (README, "Packed files")."""


class Scalar6(FormatBase):
    """The mechanism the three 6-level formats share: block scales, sorted code points, base-6 codes.
    A subclass sets ``block`` (None: the whole row), ``qmax`` and ``fit``."""

    block: int | None
    qmax: float
    table_bytes: int = N_LEVELS * 4
    comparison = True
    layout = LAYOUT
    suffixes = ("codes", "scale", "codepoints")

    def bits_per_param(self, shape) -> float:
        _, d_in = check_shape(shape)
        return LOG2_6 + 16 / (self.block or d_in)

    def storage_bytes(self, shape) -> int:
        d_out, d_in = check_shape(shape)
        n_blocks = ceil_div(d_in, self.block or d_in)
        return ceil_div(d_out * d_in, 3) + 2 * d_out * n_blocks + self.table_bytes

    def quantize(self, weight: torch.Tensor, state: State) -> torch.Tensor:
        return quantize_scalar(weight, state["codepoints"], self.block, self.qmax)

    def packed_specs(self, shape, state: State) -> PackedSpecs:
        d_out, d_in = check_shape(shape)
        n_blocks = ceil_div(d_in, self.block or d_in)
        return {"codes": (torch.uint8, (ceil_div(d_out * d_in, 3),)),
                "scale": (torch.bfloat16, (d_out, n_blocks)), "codepoints": (torch.float32, (N_LEVELS,))}

    def pack(self, weight: torch.Tensor, state: State) -> dict[str, torch.Tensor]:
        codes, scale = encode(weight.float(), state["codepoints"], self.block, self.qmax)
        return {"codes": codes, "scale": scale, "codepoints": state["codepoints"].float()}

    def unpack(self, tensors: dict[str, torch.Tensor], shape) -> torch.Tensor:
        return decode(tensors["codes"], tensors["scale"], tensors["codepoints"], self.block, shape)

    # --- scales, post-training methods, the QAT forward at a learned scale (see FormatBase) --------------

    refit_codepoints = False              # the search refits the code points too (lloyd-max: fitted to data)

    def absmax_scale(self, weight: torch.Tensor) -> torch.Tensor:
        return block_scales(weight, self.block, self.qmax)

    def expand_scale(self, scale: torch.Tensor, shape) -> torch.Tensor:
        d_in = shape[1]
        return scale.repeat_interleave(self.block or d_in, dim=1)[:, :d_in]

    def state_of(self, tensors: dict[str, torch.Tensor]) -> State:
        return {"codepoints": tensors["codepoints"]}

    def pack_at_scale(self, weight: torch.Tensor, state: State, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        check_weight(weight)
        w = weight.detach().float()
        d_out, d_in = w.shape
        cp = state["codepoints"].float()
        scale = scale.detach().to(torch.bfloat16)
        codes = codes_at_scale(blocked(w, self.block), cp, scale)
        return {"codes": pack_codes(codes, d_out, d_in), "scale": scale, "codepoints": cp}

    def values_at_scale(self, weight: torch.Tensor, state: State, scale: torch.Tensor) -> torch.Tensor:
        w = weight.detach().float()
        d_out, d_in = w.shape
        cp = state["codepoints"].float().to(w.device)
        codes = codes_at_scale(blocked(w, self.block), cp, scale.detach().to(torch.bfloat16))
        return cp[codes].reshape(d_out, -1)[:, :d_in]

    def search(self, weight: torch.Tensor, importance: torch.Tensor | None = None, *, seed: int = 0,
               fitted: State | None = None) -> tuple[State, torch.Tensor]:
        codepoints, scale = search(self, weight, importance, seed=seed,
                                   codepoints=None if fitted is None else fitted["codepoints"])
        return {"codepoints": codepoints}, scale

    def gptq(self, weight: torch.Tensor, hessian: torch.Tensor, *, seed: int = 0, fitted: State | None = None,
             compensated: torch.Tensor | None = None,
             act_order: bool = numerics.GPTQ_ACT_ORDER) -> dict[str, torch.Tensor]:
        start = search(self, weight, hessian.diagonal(), seed=seed,
                       codepoints=None if fitted is None else fitted["codepoints"])
        codes, scale, codepoints = gptq_pack(self, weight, hessian, seed=seed, start=start, compensated=compensated,
                                             act_order=act_order)
        return {"codes": codes, "scale": scale, "codepoints": codepoints}

    def row_block(self, tensors, shape, r0: int, r1: int):
        d_in = shape[1]
        b0 = r0 * d_in // 3                       # r0 is a multiple of 3: a whole byte
        return ({"codes": tensors["codes"].reshape(-1)[b0:b0 + ceil_div((r1 - r0) * d_in, 3)],
                 "scale": tensors["scale"][r0:r1], "codepoints": tensors["codepoints"]}, (r1 - r0, d_in))
