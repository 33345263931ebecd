"""S3D8: 3 weights in 1 byte (SPEC section 1), the Python reference every other implementation matches.

Three weights of consecutive output channels at the same input index share a byte: a 5-bit index
``q`` into a per-matrix table ``T[32, 3]`` of absolute values, and three sign selectors laid out as
``byte = (q << 1) | s0 | (s1 << 6) | ((s0 ^ s2) << 7)``. The decoded weight is
``(s_j ? -1 : +1) * T[q][j] * scale[row]`` with a bf16 absmax/127 scale per output channel.

Float arithmetic is spelt out so that the native encoder can reproduce it bit for bit: the distance
to a centroid is ``(e0*e0 + e1*e1) + e2*e2`` in float32 (no fused multiply-add), ``e_j = |v_j| - T[i][j]``,
and ties go to the lowest index.
"""

from __future__ import annotations

import warnings

import torch

from pipeline.packed import layout
from pipeline.formats import numerics
from pipeline.formats.base import FormatBase, PackedSpecs, State, ceil_div, check_shape, check_weight
from pipeline.formats.numerics import SMALLEST_SCALE
from pipeline.packed.layout import GROUP, N_CENTROIDS, TABLE_SHAPE
from pipeline.quant import INT8_MAX, straight_through

NAME = "s3d8"
TABLE_BYTES = N_CENTROIDS * GROUP

# Work sizes per device type: (vectors per nearest-centroid step, weights per encoding block). On the CPU a
# step's two [32, chunk] float32 buffers stay in cache (1 MiB each) and a block is 32 MiB; on an accelerator
# each step is one kernel launch, so steps are large (two 512 MiB buffers, blocks of 512 MiB): a whole 11B
# fake-quantisation is some 800 steps instead of 430,000. Same arithmetic, so the same bits, at any size.
_WORK_SIZES = {"cpu": (8192, 1 << 23)}
_ACCELERATOR_WORK_SIZES = (1 << 22, 1 << 27)


def _work_sizes(device: torch.device) -> tuple[int, int]:
    return _WORK_SIZES.get(device.type, _ACCELERATOR_WORK_SIZES)


def packed_shape(shape) -> tuple[int, int]:
    return layout.packed_shape(*check_shape(shape))


def check_table(table: torch.Tensor) -> torch.Tensor:
    """Validate a centroid table: int8 (or integer) ``[32, 3]`` with values in [0, 127]."""
    if not isinstance(table, torch.Tensor):
        raise ValueError(f"table: expected a torch.Tensor, got {type(table).__name__}")
    if tuple(table.shape) != TABLE_SHAPE:
        raise ValueError(f"table: expected shape [32, 3], got {list(table.shape)}")
    if table.is_floating_point() or table.dtype == torch.bool or table.is_complex():
        raise ValueError(f"table: expected an integer dtype (int8), got {table.dtype}")
    if table.numel() and (int(table.min()) < 0 or int(table.max()) > 127):
        raise ValueError(f"table: values must lie in [0, 127], got [{int(table.min())}, {int(table.max())}]")
    return table.to(torch.int8)


def nearest_centroid(a: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centroid (Euclidean, first on ties) for each row of ``a [N, 3]``."""
    return _nearest_columns(a.float().T.contiguous(), centroids)


def _nearest_columns(a_t: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """``nearest_centroid`` for vectors stored as columns, ``a_t [3, N]``.

    Distances are laid out ``[32, chunk]`` so every step is a contiguous vector operation; the
    first minimal index is found as ``min(where(d == min(d), i, 32))`` (torch's argmin over a short
    axis is several times slower). Temporaries are two ``[32, chunk]`` buffers (:func:`_work_sizes`).
    """
    c = centroids.float().to(a_t.device)
    n = a_t.shape[1]
    chunk = _work_sizes(a_t.device)[0]
    index = torch.arange(c.shape[0], dtype=torch.int32, device=a_t.device)[:, None]
    out = torch.empty(n, dtype=torch.int64, device=a_t.device)
    dist = torch.empty(c.shape[0], min(n, chunk), device=a_t.device)
    err = torch.empty_like(dist)
    for start in range(0, n, chunk):
        part = a_t[:, start:start + chunk]
        d, e = dist[:, :part.shape[1]], err[:, :part.shape[1]]
        torch.sub(part[0], c[:, 0:1], out=d)     # (a - T)^2 == (T - a)^2 exactly
        d.mul_(d)
        for j in (1, 2):
            torch.sub(part[j], c[:, j:j + 1], out=e)
            d.add_(e.mul_(e))
        out[start:start + part.shape[1]] = torch.where(d == d.amin(0), index, c.shape[0]).amin(0)
    return out


def _fast_nearest(t: torch.Tensor):
    """:func:`_nearest_columns`, or the native step with the same arithmetic (tested bit for bit, much faster) when
    it is built and ``t`` is a float32 CPU tensor."""
    native = _native_for(t, None)
    return _nearest_columns if native is None or t.dtype != torch.float32 else native.nearest_centroids


def _normalised_groups(weight: torch.Tensor, scale: torch.Tensor, row0: int, rows: int,
                       d_in_padded: int) -> torch.Tensor:
    """Rows ``row0 .. row0+rows`` (a multiple of 3, zero-padded past d_out and d_in) divided by their
    scales, as vectors ``[rows / 3, d_in_padded, 3]``."""
    d_out, d_in = weight.shape
    block = torch.zeros(rows, d_in_padded, dtype=torch.float32, device=weight.device)
    block_scale = torch.ones(rows, 1, dtype=torch.float32, device=weight.device)
    real = max(0, min(rows, d_out - row0))
    block[:real, :d_in] = weight[row0:row0 + real].detach().float()
    block_scale[:real] = scale[row0:row0 + real].float()
    block.div_(block_scale)
    return block.view(rows // GROUP, GROUP, d_in_padded).transpose(1, 2)


def _iter_assign(weight, table, scale):
    """Yield ``(g0, q [G_b, K] int64, signs [G_b, K, 3] bool)`` for blocks of groups, so that
    temporaries stay bounded (a few times the block of :func:`_work_sizes`) whatever the matrix size."""
    n_groups, d_in_padded = packed_shape(weight.shape)
    groups_per_block = max(1, _work_sizes(weight.device)[1] // (GROUP * d_in_padded))
    for g0 in range(0, n_groups, groups_per_block):
        g1 = min(n_groups, g0 + groups_per_block)
        v = _normalised_groups(weight, scale, g0 * GROUP, (g1 - g0) * GROUP, d_in_padded)
        columns = v.abs().permute(2, 0, 1).reshape(GROUP, -1)     # [3, G_b * K]
        q = _nearest_columns(columns, table).view(g1 - g0, d_in_padded)
        yield g0, q, v < 0




def weight_scale(weight: torch.Tensor) -> torch.Tensor:
    """SPEC section 1's channel scale of a weight row, ``bf16(max(absmax / 127, 2^-126))`` (the reference
    packer's rule; ``[d_out, 1]`` bf16): an all-zero row gets 2^-126 and decodes to about 0. Activations keep
    ``pipeline.quant.channel_scale`` (absmax 0 -> 1, SPEC section 2)."""
    absmax = weight.detach().float().abs().amax(dim=-1, keepdim=True)
    return torch.clamp(absmax / 127, min=SMALLEST_SCALE).to(torch.bfloat16)


def encode(weight: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``weight [d_out, d_in]``: ``(packed uint8 [ceil(d_out/3), pad16(d_in)], scale bf16 [d_out, 1])``."""
    check_weight(weight)
    table = check_table(table)
    scale = weight_scale(weight)
    packed = torch.empty(packed_shape(weight.shape), dtype=torch.uint8, device=weight.device)
    for g0, q, signs in _iter_assign(weight, table, scale):
        s = signs.to(torch.int64)
        byte = (q << 1) | s[..., 0] | (s[..., 1] << 6) | ((s[..., 0] ^ s[..., 2]) << 7)
        packed[g0:g0 + q.shape[0]] = byte.to(torch.uint8)
    return packed, scale


def check_scale(scale: torch.Tensor, d_out: int) -> torch.Tensor:
    """Validate channel scales for :func:`encode_with_scale`: ``d_out`` finite values > 0, returned as
    bf16 ``[d_out, 1]`` (a float scale is rounded to bf16 once, nearest even; it must stay > 0)."""
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point():
        raise ValueError(f"scale: expected a floating-point tensor, got "
                         f"{scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__}")
    if scale.numel() != d_out:
        raise ValueError(f"scale: expected {d_out} channel scales, got shape {list(scale.shape)}")
    s = scale.detach().reshape(d_out, 1).to(torch.bfloat16)
    if not bool(torch.isfinite(s).all()):
        raise ValueError(f"scale: contains NaN or Inf (first at row {int((~torch.isfinite(s)).nonzero()[0, 0])})")
    if bool((s <= 0).any()):
        raise ValueError(f"scale: must be > 0 after rounding to bf16 (row {int((s <= 0).nonzero()[0, 0])} "
                         f"is {float(s[(s <= 0)][0])})")
    return s


def pack_codes(q: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Bytes from centroid indices ``q [G, K]`` and sign selectors ``signs [G, K, 3]`` (True: negative)."""
    s = signs.to(torch.int64)
    byte = (q.to(torch.int64) << 1) | s[..., 0] | (s[..., 1] << 6) | ((s[..., 0] ^ s[..., 2]) << 7)
    return byte.to(torch.uint8)


def encode_with_scale(weight: torch.Tensor, table: torch.Tensor,
                      scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`encode` with given channel scales (a searched, clipping scale) instead of absmax/127.

    Codes are the nearest centroid (same float arithmetic as :func:`encode`) of ``|W / scale|``; values
    beyond 127 (a clipping scale) are not clamped first: the nearest centroid of the unclamped vector is
    the one with the smallest reconstruction error. ``encode_with_scale(w, t, weight_scale(w))`` equals
    ``encode(w, t)`` bit for bit. Returns ``(packed, scale bf16 [d_out, 1])``."""
    check_weight(weight)
    table = check_table(table)
    scale = check_scale(scale, weight.shape[0]).to(weight.device)
    packed = torch.empty(packed_shape(weight.shape), dtype=torch.uint8, device=weight.device)
    for g0, q, signs in _iter_assign(weight, table, scale):
        packed[g0:g0 + q.shape[0]] = pack_codes(q, signs)
    return packed, scale


def quantize_with_scale(weight: torch.Tensor, table: torch.Tensor, scale: torch.Tensor, *,
                        use_native: bool | None = None) -> torch.Tensor:
    """``decode(*encode_with_scale(weight, table, scale), table, shape)`` as float32, bit for bit (no
    straight-through gradient: a post-training tool). On the CPU the native encoder and decoder do it when they are
    built (bit-identical, tested; the scale search calls this for every candidate scale); ``use_native=False``: this
    module's nearest-centroid search, without packing."""
    check_weight(weight)
    table = check_table(table)
    scale = check_scale(scale, weight.shape[0]).to(weight.device)
    if _native_for(weight, use_native) is not None:
        packed, scale = encode_auto(weight, table, scale)
        return decode(packed, scale, table, weight.shape, use_native=None)
    d_out, d_in = weight.shape
    t = table.float().to(weight.device)
    n_groups, d_in_padded = packed_shape(weight.shape)
    out = torch.empty(n_groups, GROUP, d_in_padded, dtype=torch.float32, device=weight.device)
    for g0, q, signs in _iter_assign(weight, table, scale):
        mag = t[q]      # a zero magnitude stays +0.0, as the int8 decode gives it
        out[g0:g0 + q.shape[0]] = torch.where(signs & (mag != 0), -mag, mag).transpose(1, 2)
    return out.view(-1, d_in_padded)[:d_out, :d_in] * scale.float()


def signed_luts(table: torch.Tensor) -> torch.Tensor:
    """The three permuted signed lookup tables ``int8 [3, 64]`` of SPEC section 1.

    Lanes 0 and 2 are sign-minor (``L[2q + s]``), lane 1 is sign-major (``L[q + 32 s]``).
    """
    t = check_table(table).to(torch.int16)
    q = torch.arange(N_CENTROIDS, device=t.device)
    luts = torch.empty(3, 64, dtype=torch.int16, device=t.device)
    for lane, (pos, neg) in enumerate([(2 * q, 2 * q + 1), (q, q + 32), (2 * q, 2 * q + 1)]):
        luts[lane, pos] = t[:, lane]
        luts[lane, neg] = -t[:, lane]
    return luts.to(torch.int8)


def _check_packed(packed: torch.Tensor, shape) -> torch.Tensor:
    rows, cols = packed_shape(shape)
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise ValueError(f"packed: expected a uint8 tensor, got "
                         f"{packed.dtype if isinstance(packed, torch.Tensor) else type(packed).__name__}")
    if packed.numel() != rows * cols or packed.dim() not in (1, 2) or (
            packed.dim() == 2 and tuple(packed.shape) != (rows, cols)):
        raise ValueError(f"packed: a weight of shape {tuple(shape)} needs {rows} x {cols} = {rows * cols} "
                         f"bytes, got shape {list(packed.shape)} ({packed.numel()} bytes)")
    return packed.reshape(rows, cols)


def decode_int8(packed: torch.Tensor, table: torch.Tensor, shape) -> torch.Tensor:
    """Decode to the INT8 compute format ``int8 [d_out, d_in]`` through the signed lookup tables."""
    d_out, d_in = check_shape(shape)
    b = _check_packed(packed, shape).to(torch.int64)
    luts = signed_luts(table).to(b.device)
    i0 = b & 0x3F
    i1 = (b >> 1) & 0x3F
    i2 = i0 ^ (b >> 7)
    w = torch.stack([luts[0][i0], luts[1][i1], luts[2][i2]], dim=1)  # [G, 3, K]
    return w.reshape(-1, b.shape[1])[:d_out, :d_in]


def decode(packed: torch.Tensor, scale: torch.Tensor, table: torch.Tensor, shape, *,
           use_native: bool | None = False) -> torch.Tensor:
    """Decode to ``float32 [d_out, d_in]``: the INT8 value times its channel scale. ``use_native=None``: the INT8
    step on the native decoder when it is built and the bytes lie on the CPU (the same bits, and 1 byte a weight of
    temporaries where the reference's int64 indices take 8)."""
    d_out, _ = check_shape(shape)
    if not isinstance(scale, torch.Tensor) or scale.numel() != d_out:
        raise ValueError(f"scale: expected {d_out} channel scales, got "
                         f"{list(scale.shape) if isinstance(scale, torch.Tensor) else type(scale).__name__}")
    w = decode_int8_auto(packed, table, shape, use_native=use_native).float()
    return w.mul_(scale.reshape(d_out, 1).float().to(w.device))


def quantize(weight: torch.Tensor, table: torch.Tensor, *, use_native: bool | None = None) -> torch.Tensor:
    """Fake-quantised weight, equal to ``decode(*encode(weight, table), table, shape)`` bit for bit
    (for float32 input), in the weight's dtype with a straight-through gradient.

    On the CPU the native encoder and decoder do the work when they are built (``use_native=None``):
    they are bit-identical to this module (tested) and much faster, which matters most in a CPU QAT step.
    ``use_native=False`` forces the reference."""
    check_weight(weight)
    table = check_table(table)
    d_out, d_in = weight.shape
    if _native_for(weight, use_native) is not None:
        packed, scale = encode_auto(weight, table)
        w = decode(packed, scale, table, (d_out, d_in), use_native=None)
        return straight_through(weight, w.to(weight.dtype))
    scale = weight_scale(weight)
    t = table.float().to(weight.device)
    n_groups, d_in_padded = packed_shape(weight.shape)
    out = torch.empty(n_groups, GROUP, d_in_padded, dtype=torch.float32, device=weight.device)
    for g0, q, signs in _iter_assign(weight, table, scale):
        mag = t[q]                                            # [G_b, K, 3]
        out[g0:g0 + q.shape[0]] = torch.where(signs, -mag, mag).transpose(1, 2)
    w = out.view(-1, d_in_padded)[:d_out, :d_in] * scale.float()
    return straight_through(weight, w.to(weight.dtype))


def native_or_none():
    """The native kernel module, or None when it is not built."""
    try:
        from pipeline import native
    except ImportError:
        return None
    return native


def _native_for(t: torch.Tensor, use_native: bool | None):
    """The native kernel module when it is built, ``t`` lies on the CPU and ``use_native`` is not False."""
    return native_or_none() if use_native is not False and t.device.type == "cpu" else None


def encode_auto(weight: torch.Tensor, table: torch.Tensor, scale: torch.Tensor | None = None, *,
                use_native: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`encode` (``scale`` None) or :func:`encode_with_scale`, on the native encoder when it is built
    and the weight lies on the CPU (bit-identical, tested; much faster), else this module's."""
    native = _native_for(weight, use_native)
    if native is None:
        return encode(weight, table) if scale is None else encode_with_scale(weight, table, scale)
    if scale is not None:
        scale = check_scale(scale, weight.shape[0])
    return native.s3d8_encode(weight.detach().float().contiguous(), table, scale=scale)


def decode_int8_auto(packed: torch.Tensor, table: torch.Tensor, shape, *,
                     use_native: bool | None = None) -> torch.Tensor:
    """:func:`decode_int8` on the native decoder when it is built and the bytes lie on the CPU."""
    native = _native_for(packed, use_native)
    return decode_int8(packed, table, shape) if native is None else native.s3d8_decode_int8(packed, table, shape)


def _vectors_sample(weight: torch.Tensor, max_vectors: int, seed: int) -> torch.Tensor:
    """Absolute normalised 3-vectors ``[N, 3]`` of the weight (all of them, or a seeded sample)."""
    d_out, d_in = weight.shape
    n_groups = ceil_div(d_out, GROUP)
    total = n_groups * d_in
    scale = weight_scale(weight).float()
    if total <= max_vectors:
        index = torch.arange(total, device=weight.device)
    else:
        gen = torch.Generator().manual_seed(seed)
        index = torch.randint(total, (max_vectors,), generator=gen, device=gen.device).to(weight.device)
    return _group_vectors(weight, scale, index)


def _group_vectors(weight: torch.Tensor, scale: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``|W / scale|`` as 3-vectors ``[len(index), 3]`` float32 at flat (group, column) indices; the padding rows
    of the last group count as zeros."""
    d_out, d_in = weight.shape
    g, k = index // d_in, index % d_in
    cols = []
    for j in range(GROUP):
        rows = g * GROUP + j
        valid = rows < d_out
        rows = rows.clamp(max=d_out - 1)
        vals = weight[rows, k].float() / scale[rows, 0].float()
        cols.append(torch.where(valid, vals, torch.zeros_like(vals)).abs())
    return torch.stack(cols, dim=1)


def _kmeans_pp(a: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    first = torch.randint(a.shape[0], (1,), generator=gen, device=gen.device)
    centroids = [a[first[0]]]
    d2 = ((a - centroids[0]) ** 2).sum(1)
    for _ in range(1, k):
        if float(d2.sum()) <= 0:
            pick = torch.randint(a.shape[0], (1,), generator=gen, device=gen.device)[0]
        else:
            pick = torch.multinomial(d2.double(), 1, generator=gen)[0]
        centroids.append(a[pick])
        d2 = torch.minimum(d2, ((a - a[pick]) ** 2).sum(1))
    return torch.stack(centroids)


def _lloyd(a: torch.Tensor, centroids: torch.Tensor, tol: float, max_iter: int,
           weights: torch.Tensor | None = None) -> torch.Tensor:
    """(Weighted) Lloyd iterations from ``centroids`` until at most ``tol`` of the assignments change; float64
    centroids. A vector weighs ``weights[i]`` (float64), or 1."""
    wt = torch.ones(a.shape[0], dtype=torch.float64, device=a.device) if weights is None else weights
    a_w, a_t = a.double() * wt[:, None], a.T.contiguous()
    centroids = centroids.double().clone()
    assign = None
    nearest = _fast_nearest(a_t)
    for _ in range(max_iter):
        new = nearest(a_t, centroids.float())
        changed = a.shape[0] if assign is None else int((new != assign).sum())
        assign = new
        mass = torch.zeros(N_CENTROIDS, dtype=torch.float64, device=a.device).index_add_(0, assign, wt)
        sums = torch.zeros(N_CENTROIDS, GROUP, dtype=torch.float64, device=a.device).index_add_(0, assign, a_w)
        filled = mass > 0                        # an empty cluster keeps its centroid
        centroids[filled] = sums[filled] / mass[filled, None]
        if changed <= tol * a.shape[0]:
            break
    return centroids


def fit_centroids(weight: torch.Tensor, *, seed: int = 0, max_vectors: int = 2 ** 22,
                  tol: float = 1e-3, max_iter: int = 100) -> torch.Tensor:
    """Fit the ``int8 [32, 3]`` absolute-value table by Lloyd-Max (k-means) on normalised 3-vectors.

    k-means++ initialisation and subsampling are seeded; iteration stops when at most ``tol`` of
    the assignments change. To converge in seconds, Lloyd runs first on nested random subsets of
    the sample (2^12, 2^14, ..., 2^20 vectors) and each result seeds the next, ending on the whole
    sample with the same stopping rule. Centroids are rounded to the nearest integer (SPEC decision).
    """
    check_weight(weight)
    if max_vectors < 1:
        raise ValueError(f"max_vectors: must be positive, got {max_vectors}")
    a = _vectors_sample(weight.detach().cpu(), max_vectors, seed)
    gen = torch.Generator().manual_seed(seed)
    a = a[torch.randperm(a.shape[0], generator=gen, device=gen.device)]
    centroids = _kmeans_pp(a[:2 ** 16], N_CENTROIDS, gen)
    for size in sorted({min(a.shape[0], 2 ** e) for e in (12, 14, 16, 18, 20)} | {a.shape[0]}):
        centroids = _lloyd(a[:size], centroids, tol, max_iter)
    return centroids.round().clamp(0, 127).to(torch.int8)


# --- post-training methods (``pipeline.cast.ptq`` chooses one): the scale search and GPTQ's grouping ------------

def _group_error(err_rows: torch.Tensor) -> torch.Tensor:
    """Per-row errors ``[d_out]`` summed over the 3-row byte groups ``[ceil(d_out/3)]`` (float64)."""
    e = err_rows.double()
    pad = (-e.numel()) % GROUP
    return torch.nn.functional.pad(e, (0, pad)).view(-1, GROUP).sum(1)


def _rows_of_groups(mask: torch.Tensor, d_out: int) -> torch.Tensor:
    return mask.repeat_interleave(GROUP)[:d_out]


def _row_errors(w: torch.Tensor, table: torch.Tensor, scale: torch.Tensor, h: torch.Tensor):
    """Decoded weight and weighted squared error per row for codes chosen at ``scale``."""
    q = quantize_with_scale(w, table, scale)
    return q, ((w - q) ** 2 * h).sum(1)


def search_scales(w: torch.Tensor, table: torch.Tensor, h: torch.Tensor,
                  start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row bf16 scales ``[d_out, 1]`` minimising each 3-row group's weighted error for ``table``
    (grid over ``numerics.ALPHAS`` with a common alpha per group, then ``numerics.LS_STEPS`` least-squares steps
    per row), and the group errors. ``start`` (e.g. the previous round's scales) is one more candidate."""
    d_out = w.shape[0]
    absmax = w.abs().amax(1, keepdim=True)
    best_scale, best = None, None
    candidates = [numerics.bf16_scale(a * absmax / INT8_MAX) for a in numerics.ALPHAS]
    # a clip at kappa weighted-RMS of the row: one kappa per group clips an outlier row hard and leaves its
    # Gaussian neighbours (absmax ~ 3-4 RMS) alone, which no common fraction of absmax can do
    rms = ((w * w * h).sum(1, keepdim=True) / h.sum().clamp(min=1e-30)).sqrt()
    candidates += [numerics.bf16_scale(torch.minimum(absmax, k * rms) / INT8_MAX) for k in numerics.KAPPAS]
    if start is not None:
        candidates.append(start)
    for step in range(1 + numerics.LS_STEPS):
        for cand in candidates:
            _, err = _row_errors(w, table, cand, h)
            g = _group_error(err)
            if best is None:
                best_scale, best = cand.clone(), g
                continue
            better = _rows_of_groups(g < best, d_out)
            best_scale = torch.where(better[:, None], cand, best_scale)
            best = torch.minimum(best, g)
        if step == numerics.LS_STEPS:
            break
        # least squares given the codes at the current best scales: s = <w, t>_h / <t, t>_h per row
        q, _ = _row_errors(w, table, best_scale, h)
        t = q / best_scale.float()          # the signed table values (exact: q = t * scale)
        candidates = [numerics.least_squares_scale(w, t, h, best_scale, keepdim=True)]
    return best_scale, best


def _normalised_sample(w: torch.Tensor, scale: torch.Tensor, h: torch.Tensor, max_vectors: int, seed: int):
    """Absolute normalised 3-vectors ``[N, 3]`` (float32) and their weights ``h[column]`` (a seeded
    sample of at most ``max_vectors``; the padding rows count as zeros, padding columns are left out)."""
    d_out, d_in = w.shape
    n_groups = ceil_div(d_out, GROUP)
    total = n_groups * d_in
    if total <= max_vectors:
        index = torch.arange(total, device=w.device)
    else:
        gen = torch.Generator().manual_seed(seed)
        index = torch.randperm(total, generator=gen, device=gen.device)[:max_vectors].sort().values.to(w.device)
    return _group_vectors(w, scale, index), h[index % d_in].double()


def refit_table(w: torch.Tensor, scale: torch.Tensor, h: torch.Tensor, table: torch.Tensor, *, seed: int = 0,
                max_vectors: int = numerics.KMEANS_VECTORS, tol: float = 1e-3, max_iter: int = 15) -> torch.Tensor:
    """Weighted Lloyd-Max (k-means) of the table on ``|W / scale|``, warm-started from ``table``;
    a vector in column k weighs ``h[k]``. Rounded and clamped to the int8 table's [0, 127]."""
    a, wt = _normalised_sample(w, scale, h, max_vectors, seed)
    return _lloyd(a, table, tol, max_iter, weights=wt).round().clamp(0, 127).to(torch.int8)


def search(weight: torch.Tensor, importance: torch.Tensor | None = None, *, seed: int = 0,
                rounds: int = numerics.ROUNDS, table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``search`` post-training method (``pipeline.cast.ptq``): ``(table int8 [32, 3], scale bf16 [d_out, 1])``.
    ``table``: the absmax table ``fit_centroids(weight, seed=seed)`` when already at hand (it is fitted otherwise)."""
    w = weight.detach().float()
    h = numerics.weights(importance, w)
    table = fit_centroids(weight, seed=seed) if table is None else check_table(table)
    absmax_scale = weight_scale(w)
    _, err = _row_errors(w, table, absmax_scale, h)
    best = (float(err.double().sum()), table, absmax_scale)
    scale = None
    for r in range(rounds):
        scale, g = search_scales(w, table, h, start=scale)
        total = float(g.sum())
        if total < best[0]:
            best = (total, table, scale)
        if r + 1 < rounds:
            table = refit_table(w, scale, h, table, seed=seed)
    return best[1], best[2]


def gptq_pack(weight: torch.Tensor, hessian: torch.Tensor, *, seed: int = 0, start=None,
              compensated: torch.Tensor | None = None, act_order: bool = numerics.GPTQ_ACT_ORDER):
    """The ``gptq`` post-training method: ``(packed, scale bf16 [d_out, 1], table)``. ``start``: the
    ``(table, scale)`` of ``search(weight, diag(hessian), seed=seed)`` when already at hand.
    ``compensated`` (float32 ``[d_out, d_in]``) receives the error-compensated weights GPTQ quantised, rescaled
    with the refitted row scales (so their nearest codes are the result's, up to rounding). ``act_order``: the
    columns by decreasing ``H[k, k]`` (``numerics.gptq``)."""
    w = weight.detach().float()
    d_out, d_in = w.shape
    table, scale = search(w, hessian.diagonal(), seed=seed) if start is None else start
    n_groups, d_in_padded = packed_shape(w.shape)
    t = table.float()
    on = w.device
    sf = torch.ones(n_groups * GROUP, device=on)
    sf[:d_out] = scale.float().reshape(-1)
    codes = torch.empty(n_groups, d_in_padded, dtype=torch.int64, device=on)
    signs = torch.zeros(n_groups, d_in_padded, GROUP, dtype=torch.bool, device=on)
    # padding columns hold zeros, as encode() writes them
    codes[:, d_in:] = nearest_centroid(torch.zeros(1, GROUP, device=on), table)[0]

    nearest = _fast_nearest(w)

    def quant_col(k: int, col: torch.Tensor) -> torch.Tensor:
        v = torch.zeros(n_groups * GROUP, device=on)
        v[:d_out] = col
        v = (v / sf).view(n_groups, GROUP)
        q = nearest(v.abs().T.contiguous(), t)
        neg = v < 0
        codes[:, k], signs[:, k] = q, neg
        if compensated is not None:
            compensated[:, k] = col
        mag = t[q]
        return (torch.where(neg & (mag != 0), -mag, mag).reshape(-1) * sf)[:d_out]

    numerics.gptq(w, hessian, quant_col, act_order=act_order)
    packed = pack_codes(codes, signs)
    # refit each row's scale for the output error, codes kept: s = (w H t) / (t H t)
    ti = decode_int8(packed, table, (d_out, d_in)).double()
    hd = hessian.double()
    num, den = ((w.double() @ hd) * ti).sum(1), ((ti @ hd) * ti).sum(1)
    cur = scale.double().reshape(-1)
    new = numerics.bf16_scale(torch.where(den > 0, num / den.clamp(min=1e-300), cur)).double().reshape(-1)
    err = lambda s: s * s * den - 2 * s * num       # noqa: E731 (the constant w H w^T left out)
    scale = torch.where((err(new) < err(cur))[:, None], new.to(torch.bfloat16)[:, None], scale)
    if compensated is not None:
        compensated.mul_(scale.float() / cur.float()[:, None])
    return packed, scale, table



LAYOUT = layout.NAME
"""The packed layout of SPEC section 7, readable by the Llama-Mobile reference loader."""


class S3D8(FormatBase):
    """S3D8 as a format: the centroid table is its fitted state; packed as ``P.weight.packed`` (uint8,
    1-D), ``P.weight.scale`` (bf16 ``[d_out, 1]``) and ``P.weight.table`` (int8 ``[32, 3]``)."""

    name = NAME
    label = "S3D8"
    comparison = True
    native_kernel = True
    quant_method = "s3d8"
    reader = "the Llama-Mobile reference loader"
    layout = LAYOUT
    suffixes = ("packed", "scale", "table")

    def fit(self, weight: torch.Tensor, seed: int = 0) -> State:
        return {"table": fit_centroids(weight, seed=seed)}

    def quantize(self, weight: torch.Tensor, state: State) -> torch.Tensor:
        return quantize(weight, state["table"])

    def bits_per_param(self, shape) -> float:
        _, d_in = check_shape(shape)
        return 8 / 3 + 16 / d_in

    def storage_bytes(self, shape) -> int:
        rows, cols = packed_shape(shape)
        return rows * cols + 2 * shape[0] + TABLE_BYTES

    def packed_specs(self, shape, state: State) -> PackedSpecs:
        rows, cols = packed_shape(shape)
        return {"packed": (torch.uint8, (rows * cols,)), "scale": (torch.bfloat16, (shape[0], 1)),
                "table": (torch.int8, TABLE_SHAPE)}

    def pack(self, weight: torch.Tensor, state: State) -> dict[str, torch.Tensor]:
        if native_or_none() is None:  # the reference encoder is bit-identical (tested), only slower
            warnings.warn("native S3D8 library not built (run ./setup.sh); packing with the Python encoder")
        packed, scale = encode_auto(weight.float(), state["table"])
        return {"packed": packed.reshape(-1), "scale": scale, "table": state["table"]}

    def unpack(self, tensors: dict[str, torch.Tensor], shape) -> torch.Tensor:
        return decode(tensors["packed"], tensors["scale"], tensors["table"], shape, use_native=None)

    def file_metadata(self) -> dict[str, str]:
        return {"llama_mobile_format": LAYOUT}

    def row_block(self, tensors, shape, r0: int, r1: int):
        cols = packed_shape(shape)[1]
        g0, g1 = r0 // GROUP, ceil_div(r1, GROUP)
        return ({"packed": tensors["packed"].reshape(-1)[g0 * cols:g1 * cols], "scale": tensors["scale"][r0:r1],
                 "table": tensors["table"]}, (r1 - r0, shape[1]))

    # --- scales, post-training methods, the QAT forward at a learned scale (see FormatBase) --------------

    refits_state = True

    def absmax_scale(self, weight: torch.Tensor) -> torch.Tensor:
        return weight_scale(weight)

    def expand_scale(self, scale: torch.Tensor, shape) -> torch.Tensor:
        d_out, d_in = shape
        return scale.reshape(d_out, 1).expand(d_out, d_in)

    def state_of(self, tensors: dict[str, torch.Tensor]) -> State:
        return {"table": tensors["table"]}

    def pack_at_scale(self, weight: torch.Tensor, state: State, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        check_weight(weight)
        w = weight.detach().float()
        packed, scale = encode_auto(w, state["table"], check_scale(scale, w.shape[0]))
        return {"packed": packed.reshape(-1), "scale": scale, "table": check_table(state["table"])}

    def values_at_scale(self, weight: torch.Tensor, state: State, scale: torch.Tensor) -> torch.Tensor:
        w = weight.detach().float()
        packed = self.pack_at_scale(w, state, scale)["packed"]
        return decode_int8_auto(packed, state["table"], tuple(w.shape)).float()

    def search(self, weight: torch.Tensor, importance: torch.Tensor | None = None, *, seed: int = 0,
               fitted: State | None = None) -> tuple[State, torch.Tensor]:
        table, scale = search(weight, importance, seed=seed, table=None if fitted is None else fitted["table"])
        return {"table": table}, scale

    def gptq(self, weight: torch.Tensor, hessian: torch.Tensor, *, seed: int = 0, fitted: State | None = None,
             compensated: torch.Tensor | None = None,
             act_order: bool = numerics.GPTQ_ACT_ORDER) -> dict[str, torch.Tensor]:
        start = search(weight, hessian.diagonal(), seed=seed, table=None if fitted is None else fitted["table"])
        packed, scale, table = gptq_pack(weight, hessian, seed=seed, start=start, compensated=compensated,
                                         act_order=act_order)
        return {"packed": packed.reshape(-1), "scale": scale, "table": table}

    def whole_codes(self, same: torch.Tensor) -> torch.Tensor:
        """A byte's three weights share their code: all of them or none."""
        d_out, d_in = same.shape
        rows = ceil_div(d_out, GROUP) * GROUP
        groups = torch.nn.functional.pad(same, (0, 0, 0, rows - d_out), value=True)
        return groups.view(-1, GROUP, d_in).all(1).repeat_interleave(GROUP, 0)[:d_out]

    def refit_state(self, weight: torch.Tensor, scale: torch.Tensor, importance: torch.Tensor,
                    state: State) -> State:
        return {"table": refit_table(weight, scale, importance, state["table"])}

    def native_linear(self, tensors: dict[str, torch.Tensor], shape, bias: torch.Tensor | None):
        """An ``nn.Module`` running the packed bytes on the native kernels (INT8 activations per token)."""
        from pipeline import native

        return native.S3D8Linear(tensors["packed"], tensors["scale"], tensors["table"], shape, bias)

    def row_embedding(self, tensors: dict[str, torch.Tensor], shape, padding_idx: int | None = None,
                      dtype: torch.dtype = torch.float32):
        from pipeline import native

        return native.S3D8RowEmbedding(tensors["packed"], tensors["scale"], tensors["table"], shape, padding_idx,
                                       dtype)
