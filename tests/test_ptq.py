"""Post-training algorithms (pipeline/cast/ptq.py): bit-exact casts, scale search, importance, GPTQ."""

from __future__ import annotations

import pytest
import torch

from pipeline import formats
from pipeline.cast import ptq
from pipeline.formats import numerics, s3d8, scalar


def heavy(d_out: int, d_in: int, seed: int, dof: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(d_out, d_in, generator=gen)
    chi = torch.randn(d_out, d_in, int(dof), generator=gen).pow(2).mean(-1)     # Student-t: z / sqrt(chi2/dof)
    rows = torch.rand(d_out, 1, generator=gen) * 2 + 0.25                        # rows of different spread
    return (g / chi.sqrt() * rows * 0.02).float()


def correlated_inputs(n: int, d_in: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(d_in, d_in, generator=gen) / d_in ** 0.5 + torch.eye(d_in)
    gains = torch.rand(d_in, generator=gen) * 3 + 0.1
    return (torch.randn(n, d_in, generator=gen) @ mix) * gains


def cast(name: str, w: torch.Tensor, **kw) -> torch.Tensor:
    return ptq.direct_cast(formats.get(name), w, **kw)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous().view(torch.int32)


def rel(w, q, h=None):
    h = torch.ones(w.shape[1]) if h is None else h
    return float(((w - q) ** 2 * h).sum() / (w ** 2 * h).sum())


W = heavy(47, 40, seed=1)                    # d_out not a multiple of 3, d_in not of 16
X = correlated_inputs(400, 40, seed=2)
H = X.T @ X / X.shape[0]


# --- bit-exactness ----------------------------------------------------------------------------------

def test_encode_with_absmax_scale_equals_encode():
    table = s3d8.fit_centroids(W)
    packed, scale = s3d8.encode(W, table)
    packed2, scale2 = s3d8.encode_with_scale(W, table, s3d8.weight_scale(W))
    assert torch.equal(packed, packed2) and torch.equal(scale, scale2)
    assert torch.equal(bits(s3d8.quantize_with_scale(W, table, scale)), bits(s3d8.quantize(W, table, use_native=False)))


def test_quantize_with_scale_native_equals_the_reference():
    """The scale search's inner step on the native encoder and decoder gives this module's bits, at scales that
    clip (|w / scale| beyond the table) and that do not, rows of zeros and a single-column matrix included."""
    table = s3d8.fit_centroids(W)
    w = torch.cat([W, torch.zeros(2, W.shape[1])])
    for scale in (s3d8.weight_scale(w), (s3d8.weight_scale(w).float() * 0.37).to(torch.bfloat16),
                  (s3d8.weight_scale(w).float() * 3.0).to(torch.bfloat16)):
        ref = s3d8.quantize_with_scale(w, table, scale, use_native=False)
        assert torch.equal(bits(s3d8.quantize_with_scale(w, table, scale)), bits(ref))
    col = W[:, :1].contiguous()
    assert torch.equal(bits(s3d8.quantize_with_scale(col, table, s3d8.weight_scale(col))),
                       bits(s3d8.quantize_with_scale(col, table, s3d8.weight_scale(col), use_native=False)))


def test_native_nearest_centroids_equals_the_torch_search():
    """``native.nearest_centroids`` (Lloyd's and GPTQ's nearest-centroid step) gives ``_nearest_columns``' indices:
    ties to the first index, repeated centroids, zeros, far points, a strided input, no vectors."""
    from pipeline import native

    gen = torch.Generator().manual_seed(3)
    c = torch.randint(0, 128, (32, 3), generator=gen).float()
    c[7] = c[3]                                            # a repeated centroid: the first index wins
    a = torch.cat([torch.rand(3, 5000, generator=gen) * 130, c[:, :].T, torch.zeros(3, 4), torch.full((3, 2), 1e6),
                   ((c[0] + c[1]) / 2)[:, None]], 1)      # the centroids themselves; a point halfway between two
    assert torch.equal(native.nearest_centroids(a, c), s3d8._nearest_columns(a, c))
    wide = torch.rand(3, 9000, generator=gen) * 127
    assert torch.equal(native.nearest_centroids(wide[:, ::3], c), s3d8._nearest_columns(wide[:, ::3], c))
    assert native.nearest_centroids(torch.zeros(3, 0), c).shape == (0,)
    with pytest.raises(ValueError, match="centroids: expected \\[32, 3\\]"):
        native.nearest_centroids(a, c[:4])


def test_cast_with_and_without_the_native_nearest_step_is_the_same(monkeypatch):
    """The table fit, the search's refits and GPTQ give the same table, scales and bytes with the native
    nearest-centroid step as with torch's."""
    fast = (s3d8.fit_centroids(W), s3d8.search(W, H.diagonal()), s3d8.gptq_pack(W, H))
    monkeypatch.setattr(s3d8, "_native_for", lambda t, use_native: None)
    slow = (s3d8.fit_centroids(W), s3d8.search(W, H.diagonal()), s3d8.gptq_pack(W, H))
    for x, y in zip(fast, slow):
        for u, v in zip(x if isinstance(x, tuple) else (x,), y if isinstance(y, tuple) else (y,)):
            assert torch.equal(u, v)


@pytest.mark.parametrize("algorithm", ["search", "gptq"])
def test_s3d8_cast_is_its_packed_bytes_bit_for_bit(algorithm):
    kw = {"hessian": H} if algorithm == "gptq" else {}
    t = ptq.pack(formats.get("s3d8"), W, algorithm=algorithm, **kw)
    decoded = s3d8.decode(t["packed"], t["scale"], t["table"], W.shape)
    assert torch.equal(bits(cast("s3d8", W, algorithm=algorithm, **kw)), bits(decoded))
    if algorithm == "search":  # the bytes are the nearest-centroid codes for the searched scale
        packed, _ = s3d8.encode_with_scale(W, t["table"], t["scale"])
        assert torch.equal(packed.reshape(-1), t["packed"])
        assert torch.equal(bits(s3d8.quantize_with_scale(W, t["table"], t["scale"])), bits(decoded))


def test_absmax_cast_equals_the_qat_forward():
    for name in formats.QUANTISED:
        fmt = formats.get(name)
        q = cast(name, W, algorithm="absmax")
        assert torch.equal(q, fmt.quantize(W, fmt.fit(W))), name
    int8 = formats.get("int8")
    assert torch.equal(cast("int8", W, algorithm="absmax"), int8.quantize(W, int8.fit(W)))
    with pytest.raises(ValueError, match="algorithm 'search'"):
        cast("int8", W, algorithm="search")


@pytest.mark.parametrize("name", ["int", "student_t", "lloyd_max"])
@pytest.mark.parametrize("algorithm", ["search", "gptq"])
def test_scalar_cast_is_its_packed_bytes_bit_for_bit(name, algorithm):
    fmt = formats.get(name)
    kw = {"hessian": H} if algorithm == "gptq" else {}
    t = ptq.pack(formats.get(name), W, algorithm=algorithm, **kw)
    decoded = scalar.decode(t["codes"], t["scale"], t["codepoints"], fmt.block, W.shape)
    assert torch.equal(bits(cast(name, W, algorithm=algorithm, **kw)), bits(decoded))
    assert set(t) == set(fmt.packed_specs(W.shape, {}))
    for key, (dtype, shape) in fmt.packed_specs(W.shape, {}).items():
        assert t[key].dtype == dtype and tuple(t[key].shape) == shape, key


def test_scalar_codes_with_absmax_scale_equal_encode():
    fmt = formats.get("int")
    cp = fmt.fit(W)["codepoints"]
    codes, scale = scalar.encode(W, cp, fmt.block, fmt.qmax)
    ours = scalar.pack_codes(scalar.codes_at_scale(scalar.blocked(W, fmt.block), cp, scale), *W.shape)
    assert torch.equal(codes, ours)


# --- the search is never worse than absmax --------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_search_never_worse_than_absmax(seed):
    w = heavy(31 + seed, 48, seed=10 + seed, dof=2.0 + seed)
    imp = torch.rand(48, generator=torch.Generator().manual_seed(seed)) * 4
    for name in formats.QUANTISED:
        base = cast(name, w, algorithm="absmax")
        assert rel(w, cast(name, w, algorithm="search")) <= rel(w, base) + 1e-12, name
        assert rel(w, cast(name, w, algorithm="search", importance=imp), imp) <= rel(w, base, imp) + 1e-12


def test_search_helps_s3d8_on_heavy_tails():
    w = heavy(60, 96, seed=5, dof=2.0)
    assert rel(w, cast("s3d8", w, algorithm="search")) < 0.97 * rel(w, cast("s3d8", w, algorithm="absmax"))


# --- edge cases -------------------------------------------------------------------------------------

def test_zero_and_constant_rows():
    w = heavy(12, 32, seed=3)
    w[2] = 0                       # an all-zero row inside a byte group
    w[6:9] = 0                     # a whole all-zero group
    w[10] = 0.5                    # a constant row
    w[11] = -0.25
    for algorithm in ("search", "gptq"):
        t = ptq.pack(formats.get("s3d8"), w, algorithm=algorithm, hessian=H[:32, :32] if algorithm == "gptq" else None)
        q = s3d8.decode(t["packed"], t["scale"], t["table"], w.shape)
        assert torch.isfinite(q).all() and bool((t["scale"].float() > 0).all())
        assert q[[2, 6, 7, 8]].abs().max() < 1e-30, algorithm
        assert torch.allclose(q[10], w[10], rtol=0.02) and torch.allclose(q[11], w[11], rtol=0.02)
    for name in formats.QUANTISED:
        zero = torch.zeros(5, 20)
        for algorithm in ("absmax", "search"):
            q = cast(name, zero, algorithm=algorithm)
            assert torch.isfinite(q).all() and (q.abs() < 1e-30).all() or algorithm == "absmax", (name, algorithm)


def test_nan_is_rejected_naming_the_argument():
    bad = W.clone()
    bad[3, 4] = float("nan")
    with pytest.raises(ValueError, match="weight"):
        cast("s3d8", bad, algorithm="search")
    imp = torch.ones(W.shape[1])
    imp[1] = float("nan")
    with pytest.raises(ValueError, match="importance"):
        cast("s3d8", W, algorithm="search", importance=imp)
    h = H.clone()
    h[0, 1] = h[1, 0] = float("inf")
    with pytest.raises(ValueError, match="hessian"):
        cast("s3d8", W, algorithm="gptq", hessian=h)
    scale = s3d8.weight_scale(W).clone()
    scale[0] = float("nan")
    with pytest.raises(ValueError, match="scale"):
        s3d8.encode_with_scale(W, s3d8.fit_centroids(W), scale)
    with pytest.raises(ValueError, match="scale"):
        s3d8.encode_with_scale(W, s3d8.fit_centroids(W), torch.zeros(W.shape[0], 1))
    with pytest.raises(ValueError, match="importance"):
        cast("int", W, algorithm="search", importance=-torch.ones(W.shape[1]))
    with pytest.raises(ValueError, match="algorithm"):
        cast("s3d8", W, algorithm="awq")


def test_deterministic_for_a_seed():
    for name in ("s3d8", "lloyd_max"):
        a = ptq.pack(formats.get(name), W, algorithm="search", seed=3)
        b = ptq.pack(formats.get(name), W, algorithm="search", seed=3)
        assert all(torch.equal(a[k], b[k]) for k in a), name
    a, b = (cast("s3d8", W, algorithm="gptq", hessian=H) for _ in range(2))
    assert torch.equal(a, b)


# --- GPTQ -------------------------------------------------------------------------------------------

def output_error(w, q, x):
    return float(((w - q) @ x.T).pow(2).sum() / (w @ x.T).pow(2).sum())


def test_gptq_lowers_the_output_error():
    w = heavy(48, 64, seed=7)
    x, held_out = correlated_inputs(2000, 64, seed=8).split(1000)     # calibration and held-out tokens
    h = x.T @ x / x.shape[0]
    for name in ("s3d8", "int"):
        direct = output_error(w, cast(name, w, algorithm="absmax"), held_out)
        search = output_error(w, cast(name, w, algorithm="search", importance=h.diagonal()), held_out)
        gptq = output_error(w, cast(name, w, algorithm="gptq", hessian=h), held_out)
        assert gptq < 0.8 * direct and gptq < search, (name, direct, search, gptq)


def test_gptq_act_order():
    """Columns by decreasing H[k, k]: each rounded under its own index, and the result put back in place (with a
    diagonal H there is no error feedback, so the order cannot matter); on inputs of unequal gains, where it is
    meant to pay, the held-out output error is lower than in index order for every seed."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(6, 10, generator=gen)
    calls = []

    def rounded(k, col):
        calls.append(k)
        return (col * 4).round() / 4

    diag = torch.diag(torch.rand(10, generator=gen) + 0.5)
    q = numerics.gptq(w, diag, rounded, block=4, act_order=True)
    assert calls == torch.argsort(diag.diagonal(), descending=True).tolist()
    assert torch.equal(q, numerics.gptq(w, diag, rounded, act_order=False)) and torch.equal(q, (w * 4).round() / 4)
    for seed in range(3):
        w = heavy(48, 64, seed=7 + seed)
        x, held_out = correlated_inputs(2000, 64, seed=8 + seed).split(1000)
        h = x.T @ x / x.shape[0]
        for name in ("s3d8", "int"):
            fmt = formats.get(name)
            err = {a: output_error(w, fmt.unpack(ptq.pack(fmt, w, algorithm="gptq", hessian=h, act_order=a),
                                                 w.shape), held_out) for a in (False, True)}
            assert err[True] < err[False], (seed, name, err)


def test_gptq_with_the_diagonal_only_is_the_weighted_search():
    imp = H.diagonal().clone()
    assert torch.equal(cast("s3d8", W, algorithm="gptq", importance=imp),
                       cast("s3d8", W, algorithm="search", importance=imp))


# --- calibration ------------------------------------------------------------------------------------

def test_collect_importance_and_hessians_on_a_tiny_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    batches = [torch.randn(4, 2, 6), torch.randn(3, 6)]
    imp = ptq.collect_importance(model, batches)
    hess = ptq.collect_hessians(model, batches)
    x0 = torch.cat([b.reshape(-1, 6) for b in batches]).double()
    x1 = torch.relu(model[0](x0.float())).double()
    assert set(imp) == {"0", "2"} and imp["0"].dtype == torch.float32
    assert torch.allclose(imp["0"].double(), (x0 ** 2).mean(0), rtol=1e-6)
    assert torch.allclose(imp["2"].double(), (x1 ** 2).mean(0), rtol=1e-5)
    assert torch.allclose(hess["0"].double(), x0.T @ x0 / x0.shape[0], rtol=1e-6)
    assert torch.allclose(hess["2"].diagonal(), imp["2"])
    assert not model[0]._forward_pre_hooks                   # hooks removed
    assert set(ptq.collect_importance(model, [{"input": batches[1]}], names=["2"])) == {"2"}
    with pytest.raises(ValueError, match="names"):
        ptq.collect_importance(model, batches, names=["1"])


@pytest.mark.parametrize("name", formats.QUANTISED)
def test_fit_and_cast_allocate_on_the_weights_device(name, monkeypatch):
    """Stage direct-cast runs on a GPU where there is one: no tensor of a fit or a post-training algorithm may be
    created on torch's default device. With ``meta`` as the default, any such tensor meets the CPU weight and
    fails; the result must equal the plain run's bit for bit."""
    monkeypatch.setattr(s3d8, "native_or_none", lambda: None)      # the torch path, the one a GPU runs
    fmt = formats.get(name)
    algorithms = ["search", "gptq"] if fmt.comparison else ["absmax"]
    for algorithm in algorithms:
        hessian = H if algorithm == "gptq" else None
        expected = ptq.cast(fmt, W, algorithm=algorithm, hessian=hessian)
        with torch.device("meta"):
            got = ptq.cast(fmt, W, algorithm=algorithm, hessian=hessian, fitted=fmt.fit(W, seed=0))
        assert {k: v.device.type for k, v in got[0].items()} == {k: "cpu" for k in expected[0]}
        for k, v in expected[0].items():
            assert torch.equal(got[0][k], v), (algorithm, k)
        assert torch.equal(bits(got[1]), bits(expected[1])), algorithm
