"""Property tests (hypothesis) of the native entry points: random shapes, strides, dtypes and values
(-128, NaN, +-Inf, -0.0, denormals, huge, k beyond the int32 bound). Every call ends in one of:

- a ``ValueError`` that names the argument at fault, when the input breaks the contract; or
- the right answer: bit for bit the Python reference (``pipeline.quant``, ``pipeline.formats.s3d8``),
  NaN positions and bits included (the non-finite policy of ``pipeline.native``).

Never a crash, another exception type, or a silent wrong answer. Inputs C cannot read as they are
(transposed, sliced, expanded, lazily negated) must give the answer of the plain tensor.

Each property draws a case kind: "valid" (about half of the cases) or one malformation. The counts
tried per entry point are printed at the end of the module. ``S3D8_FUZZ_EXAMPLES=N`` runs N examples
per property (default 60: the file takes well under a minute); the seed is random on every run
(hypothesis prints the failing example to reproduce it).
"""

from __future__ import annotations

import collections
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import native
from pipeline.formats import s3d8
from pipeline.quant import int8_activations, int8_matmul_reference

VARIANTS = native.available_variants()
EXAMPLES = int(os.environ.get("S3D8_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FLT_MAX = 3.4028234663852886e38
SPECIALS = [float("nan"), float("inf"), -float("inf"), -0.0, 1e-45, 1e-40, FLT_MAX,
            -FLT_MAX, 0.5, -2.5, 1e30]
TRIED: collections.Counter = collections.Counter()   # (entry point, "valid" | "malformed")


@pytest.fixture(scope="module", autouse=True)
def report_counts(request):
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    entries = sorted({e for e, _ in TRIED})
    line = "; ".join(f"{e}: {TRIED[e, 'valid'] + TRIED[e, 'malformed']} cases, "
                     f"{TRIED[e, 'malformed']} malformed" for e in entries)
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None and line:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\nnative fuzz ({EXAMPLES} examples per property): {line}")


# ---- helpers ----------------------------------------------------------------------------------

def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {4: torch.int32, 2: torch.int16, 1: torch.int8}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def gen_of(data) -> torch.Generator:
    return torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31 - 1), label="seed"))


def floats(data, shape, gen, specials: bool = True, finite: bool = False) -> torch.Tensor:
    """float32 values of a drawn magnitude, with a few special values at drawn positions."""
    mag = data.draw(st.sampled_from([1.0, 1e-3, 1e4, 1e-38, 1e30]), label="magnitude")
    x = torch.randn(shape, generator=gen) * mag
    if data.draw(st.booleans(), label="zero row") and x.dim() >= 2 and x.shape[0] > 0:
        x[0] = 0.0
    if x.numel() and specials:
        flat = x.view(-1)
        for _ in range(data.draw(st.integers(0, 3), label="n specials")):
            value = data.draw(st.sampled_from(SPECIALS), label="special")
            if finite and value != value or abs(value) == float("inf") and finite:
                continue
            flat[data.draw(st.integers(0, flat.numel() - 1), label="position")] = value
    return x


def layout(data, t: torch.Tensor, what: str) -> torch.Tensor:
    """The same values as ``t`` in a layout C cannot read directly (or ``t`` itself)."""
    how = data.draw(st.sampled_from(["plain", "plain", "transposed", "strided", "neg", "expanded"]),
                    label=f"{what} layout")
    if how == "transposed" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if how == "strided" and t.dim() >= 1:
        wide = torch.zeros(*t.shape[:-1], t.shape[-1] * 2, dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    if how == "neg" and t.dtype != torch.uint8:
        return torch._neg_view(-t)
    if how == "expanded" and t.dim() >= 2 and t.shape[0] > 1:
        t[:] = t[:1].clone()                                 # the caller's copy holds the same values
        return t[:1].expand(*t.shape)
    return t


def random_table(gen) -> torch.Tensor:
    table = torch.randint(0, 128, (32, 3), dtype=torch.int8, generator=gen)
    table[0] = 127
    return table


def random_packed(d_out: int, d_in: int, gen) -> torch.Tensor:
    return torch.randint(0, 256, (-(-d_out // 3), -(-d_in // 16) * 16), dtype=torch.uint8, generator=gen)


def random_scale(data, d_out: int, gen) -> torch.Tensor:
    scale = (torch.rand(d_out, 1, generator=gen) * 0.02 + 1e-4).to(torch.bfloat16)
    for _ in range(data.draw(st.integers(0, 2), label="n special scales")):
        c = data.draw(st.integers(0, d_out - 1), label="scale position")
        scale[c] = data.draw(st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0, -0.01, 1e-40]),
                             label="special scale")
    return scale


def expect_value_error(call, names: str) -> None:
    """``call()`` must raise ValueError whose message starts with one of the argument names."""
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert any(message.startswith(n) for n in names.split("|")), message


def draw_kind(data, entry: str, malformed: list[str]) -> str:
    kind = data.draw(st.sampled_from(["valid"] * len(malformed) + malformed), label="kind")
    TRIED[entry, "valid" if kind == "valid" else "malformed"] += 1
    return kind


def bad_threads(data):
    return data.draw(st.sampled_from([0, -1, 1025, True, 1.5, "2"]), label="bad threads")


def bad_variant(data):
    return data.draw(st.sampled_from(["sse9", 3, b"avx2", ""]), label="bad variant")


def _k_over(data, limit: int) -> int:
    return limit + data.draw(st.integers(1, 40), label="k over")


# ---- properties -------------------------------------------------------------------------------

@FUZZ
@given(st.data())
def test_fuzz_s3d8_matmul(data):
    kind = draw_kind(data, "s3d8_matmul", [
        "x_dtype", "x_last_dim", "x_device", "packed_dtype", "packed_size", "scale_dtype",
        "scale_count", "table_negative", "table_shape", "table_dtype", "k_too_large", "threads",
        "variant", "shape", "path"])
    gen = gen_of(data)
    variant = data.draw(st.sampled_from(VARIANTS), label="variant")
    threads = data.draw(st.integers(1, 3), label="threads")
    path = data.draw(st.sampled_from([None, *native.PATHS]), label="path")
    d_out = data.draw(st.integers(1, 40), label="d_out")
    d_in = _k_over(data, native.K_MAX) if kind == "k_too_large" else data.draw(st.integers(1, 160), label="d_in")
    m = data.draw(st.integers(0, 2 if kind == "k_too_large" else 20), label="m")
    lead = (2, m) if data.draw(st.booleans(), label="3-D x") else (m,)
    x = floats(data, (*lead, d_in), gen)
    packed, scale, table = random_packed(d_out, d_in, gen), random_scale(data, d_out, gen), random_table(gen)
    shape = (d_out, d_in)
    args = dict(variant=variant, threads=threads, path=path)
    if kind == "valid":
        x_in = layout(data, x, "x")
        x_ref = x_in.resolve_neg().contiguous()
        packed_in, scale_in, table_in = (layout(data, t, n) for t, n in ((packed, "packed"), (scale, "scale"),
                                                                          (table, "table")))
        got = native.s3d8_matmul(x_in, packed_in, scale_in, table_in, shape, **args)
        xq, xs = int8_activations(x_ref.reshape(-1, d_in))
        expected = int8_matmul_reference(xq, xs, s3d8.decode_int8(packed, table, shape), scale)
        assert same_bits(got, expected.reshape(*lead, d_out))
        return
    bad = {"x": x, "packed": packed, "scale": scale, "table": table, "shape": shape}
    if kind == "x_dtype":
        bad["x"] = x.to(data.draw(st.sampled_from([torch.float64, torch.bfloat16, torch.float16, torch.int32])))
    elif kind == "x_last_dim":
        bad["x"] = floats(data, (max(m, 1), d_in + data.draw(st.sampled_from([-1, 1]))), gen) if d_in > 1 \
            else torch.zeros(1, 2)
    elif kind == "x_device":
        bad["x"] = x.to("meta") if data.draw(st.booleans()) else x.reshape(-1, d_in).to_sparse()
    elif kind == "packed_dtype":
        bad["packed"] = packed.view(torch.int8)
    elif kind == "packed_size":
        bad["packed"] = torch.zeros(packed.numel() + data.draw(st.sampled_from([-16, 16, 1])), dtype=torch.uint8)
    elif kind == "scale_dtype":
        bad["scale"] = data.draw(st.sampled_from([scale.float(), scale.half(), scale.view(torch.int16)]))
    elif kind == "scale_count":
        bad["scale"] = torch.ones(d_out + data.draw(st.sampled_from([-1, 1])), dtype=torch.bfloat16)
    elif kind == "table_negative":
        table[data.draw(st.integers(0, 31)), data.draw(st.integers(0, 2))] = data.draw(st.integers(-128, -1))
    elif kind == "table_shape":
        bad["table"] = data.draw(st.sampled_from([table[:31].contiguous(), table.flatten(), table[:, :2].contiguous()]))
    elif kind == "table_dtype":
        bad["table"] = table.to(data.draw(st.sampled_from([torch.uint8, torch.int16, torch.float32])))
    elif kind == "shape":
        bad["shape"] = data.draw(st.sampled_from([(d_out, d_in + 0.5), (0, d_in), (d_out,), (d_out, -d_in),
                                                  (True, d_in), "shape"]))
    names = {"x_dtype": "x", "x_last_dim": "x", "x_device": "x", "packed_dtype": "packed",
             "packed_size": "packed", "scale_dtype": "scale", "scale_count": "scale",
             "table_negative": "table", "table_shape": "table", "table_dtype": "table",
             "k_too_large": "shape", "threads": "threads", "variant": "variant", "shape": "shape|packed",
             "path": "path"}[kind]
    if kind == "threads":
        args["threads"] = bad_threads(data)
    elif kind == "variant":
        args["variant"] = bad_variant(data)
    elif kind == "path":
        args["path"] = "magic"
    expect_value_error(lambda: native.s3d8_matmul(bad["x"], bad["packed"], bad["scale"], bad["table"],
                                                  bad["shape"], **args), names)


@FUZZ
@given(st.data())
def test_fuzz_int8_matmul(data):
    kind = draw_kind(data, "int8_matmul", [
        "x_dtype", "x_last_dim", "weight_dtype", "weight_dims", "weight_empty", "scale_dtype",
        "scale_count", "k_too_large", "k_minus128", "threads", "variant", "path"])
    gen = gen_of(data)
    variant = data.draw(st.sampled_from(VARIANTS), label="variant")
    threads = data.draw(st.integers(1, 3), label="threads")
    path = data.draw(st.sampled_from([None, "fused", "torch", "tiled"]), label="path")
    d_out = data.draw(st.integers(1, 40), label="d_out")
    if kind == "k_too_large":
        d_in = _k_over(data, native.K_MAX)
    elif kind == "k_minus128":
        d_in = _k_over(data, native.K_MAX_INT8_FULL)
    else:
        d_in = data.draw(st.integers(1, 200), label="d_in")
    m = data.draw(st.integers(0, 2 if kind.startswith("k_") else 20), label="m")
    x = floats(data, (m, d_in), gen)
    w = torch.randint(-128, 128, (d_out, d_in), dtype=torch.int8, generator=gen)
    if data.draw(st.booleans(), label="-128 row"):
        w[data.draw(st.integers(0, d_out - 1))] = -128
    scale = random_scale(data, d_out, gen)
    args = dict(variant=variant, threads=threads, path=path)
    if kind == "valid":
        x_in, w_in, s_in = layout(data, x, "x"), layout(data, w, "weight"), layout(data, scale, "scale")
        x_ref = x_in.resolve_neg().contiguous()
        got = native.int8_matmul(x_in, w_in, s_in, **args)
        xq, xs = int8_activations(x_ref)
        assert same_bits(got, int8_matmul_reference(xq, xs, w, scale))
        return
    bad = {"x": x, "weight": w, "scale": scale}
    names = {"x_dtype": "x", "x_last_dim": "x", "weight_dtype": "weight", "weight_dims": "weight",
             "weight_empty": "weight", "scale_dtype": "scale", "scale_count": "scale",
             "k_too_large": "weight", "k_minus128": "weight (holds -128)", "threads": "threads",
             "variant": "variant", "path": "path"}[kind]
    if kind == "x_dtype":
        bad["x"] = x.to(data.draw(st.sampled_from([torch.float64, torch.bfloat16, torch.int8])))
    elif kind == "x_last_dim":
        bad["x"] = torch.zeros(1, d_in + 1)
    elif kind == "weight_dtype":
        bad["weight"] = data.draw(st.sampled_from([w.view(torch.uint8), w.float(), w.to(torch.int16)]))
    elif kind == "weight_dims":
        bad["weight"] = data.draw(st.sampled_from([w.flatten(), w.reshape(1, d_out, d_in)]))
    elif kind == "weight_empty":
        bad["weight"], bad["x"] = torch.zeros(d_out, 0, dtype=torch.int8), torch.zeros(m, 0)
    elif kind == "scale_dtype":
        bad["scale"] = data.draw(st.sampled_from([scale.float(), scale.view(torch.int16)]))
    elif kind == "scale_count":
        bad["scale"] = torch.ones(d_out + 1, dtype=torch.bfloat16)
    elif kind == "k_minus128":
        w[0, -1] = -128
    elif kind == "threads":
        args["threads"] = bad_threads(data)
    elif kind == "variant":
        args["variant"] = bad_variant(data)
    elif kind == "path":
        args["path"] = "magic"
    expect_value_error(lambda: native.int8_matmul(bad["x"], bad["weight"], bad["scale"], **args), names)


@FUZZ
@given(st.data())
def test_fuzz_quantize_activations(data):
    kind = draw_kind(data, "quantize_activations", ["x_dtype", "x_dims", "x_empty_k", "x_device",
                                                    "threads", "variant", "not_tensor"])
    gen = gen_of(data)
    variant = data.draw(st.sampled_from(VARIANTS), label="variant")
    threads = data.draw(st.integers(1, 3), label="threads")
    m, k = data.draw(st.integers(0, 20), label="m"), data.draw(st.integers(1, 300), label="k")
    x = floats(data, (m, k), gen)
    args = dict(variant=variant, threads=threads)
    if kind == "valid":
        x_in = layout(data, x, "x")
        q, scale = native.quantize_activations(x_in, **args)
        q_ref, scale_ref = int8_activations(x_in.resolve_neg().contiguous())
        assert torch.equal(q, q_ref) and same_bits(scale, scale_ref)
        return
    bad = x
    if kind == "x_dtype":
        bad = x.to(data.draw(st.sampled_from([torch.float64, torch.bfloat16, torch.int32])))
    elif kind == "x_dims":
        bad = data.draw(st.sampled_from([x.flatten(), x.reshape(1, m, k)]))
    elif kind == "x_empty_k":
        bad = torch.zeros(m, 0)
    elif kind == "x_device":
        bad = x.to("meta")
    elif kind == "not_tensor":
        bad = x.tolist()
    elif kind == "threads":
        args["threads"] = bad_threads(data)
    elif kind == "variant":
        args["variant"] = bad_variant(data)
    names = {"threads": "threads", "variant": "variant"}.get(kind, "x")
    expect_value_error(lambda: native.quantize_activations(bad, **args), names)


@FUZZ
@given(st.data())
def test_fuzz_s3d8_decode_int8(data):
    kind = draw_kind(data, "s3d8_decode_int8", [
        "packed_dtype", "packed_size", "packed_dims", "table_negative", "table_shape", "table_dtype",
        "shape", "out_dtype", "out_shape", "out_layout", "out_overlap", "threads", "variant"])
    gen = gen_of(data)
    variant = data.draw(st.sampled_from(VARIANTS), label="variant")
    threads = data.draw(st.integers(1, 3), label="threads")
    d_out, d_in = data.draw(st.integers(1, 50), label="d_out"), data.draw(st.integers(1, 200), label="d_in")
    packed, table = random_packed(d_out, d_in, gen), random_table(gen)
    shape = (d_out, d_in)
    args = dict(variant=variant, threads=threads)
    if kind == "valid":
        out = torch.empty(d_out, d_in, dtype=torch.int8) if data.draw(st.booleans(), label="out") else None
        got = native.s3d8_decode_int8(layout(data, packed, "packed"), layout(data, table, "table"), shape,
                                      out=out, **args)
        assert torch.equal(got, s3d8.decode_int8(packed, table, shape))
        assert out is None or got is out
        return
    bad = {"packed": packed, "table": table, "shape": shape, "out": None}
    if kind == "packed_dtype":
        bad["packed"] = packed.view(torch.int8)
    elif kind == "packed_size":
        bad["packed"] = packed[:, :-16].contiguous() if packed.shape[1] > 16 else packed[:, :15].contiguous()
    elif kind == "packed_dims":
        bad["packed"] = packed.reshape(1, *packed.shape)
    elif kind == "table_negative":
        table[data.draw(st.integers(0, 31)), data.draw(st.integers(0, 2))] = data.draw(st.integers(-128, -1))
    elif kind == "table_shape":
        bad["table"] = table[:, :2].contiguous()
    elif kind == "table_dtype":
        bad["table"] = table.to(torch.uint8)
    elif kind == "shape":
        bad["shape"] = data.draw(st.sampled_from([(d_out + 3, d_in), (d_out, d_in + 16), (d_out, 0), (7.0, d_in),
                                                  None]))
    elif kind == "out_dtype":
        bad["out"] = torch.empty(d_out, d_in, dtype=torch.uint8)
    elif kind == "out_shape":
        bad["out"] = torch.empty(d_out, d_in + 1, dtype=torch.int8)
    elif kind == "out_layout":
        strided = torch.empty(2 * d_out, d_in, dtype=torch.int8)[::2]     # contiguous when d_out = 1
        neg = torch._neg_view(torch.empty(d_out, d_in, dtype=torch.int8))
        bad["out"] = data.draw(st.sampled_from([strided, neg] if d_out > 1 else [neg]))
    elif kind == "out_overlap":
        buf = torch.zeros(packed.numel() + d_out * d_in, dtype=torch.uint8)
        buf[:packed.numel()] = packed.flatten()
        bad["packed"] = buf[:packed.numel()]
        start = data.draw(st.integers(0, packed.numel() - 1), label="overlap start")
        bad["out"] = buf[start:start + d_out * d_in].view(torch.int8).view(d_out, d_in)
    elif kind == "threads":
        args["threads"] = bad_threads(data)
    elif kind == "variant":
        args["variant"] = bad_variant(data)
    names = {"packed_dtype": "packed", "packed_size": "packed", "packed_dims": "packed",
             "table_negative": "table", "table_shape": "table", "table_dtype": "table",
             "shape": "shape|packed", "out_dtype": "out", "out_shape": "out", "out_layout": "out",
             "out_overlap": "out", "threads": "threads", "variant": "variant"}[kind]
    expect_value_error(lambda: native.s3d8_decode_int8(bad["packed"], bad["table"], bad["shape"],
                                                       out=bad["out"], **args), names)


@FUZZ
@given(st.data())
def test_fuzz_s3d8_encode(data):
    kind = draw_kind(data, "s3d8_encode", ["weight_nonfinite", "weight_dtype", "weight_dims",
                                           "weight_empty", "table_negative", "table_shape",
                                           "table_dtype", "threads", "variant"])
    gen = gen_of(data)
    variant = data.draw(st.sampled_from(VARIANTS), label="variant")
    threads = data.draw(st.integers(1, 3), label="threads")
    d_out, d_in = data.draw(st.integers(1, 30), label="d_out"), data.draw(st.integers(1, 100), label="d_in")
    w = floats(data, (d_out, d_in), gen, finite=True).clamp_(-3e38, 3e38)
    dtype = data.draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float16]),
                      label="dtype")
    if dtype != torch.float32:   # finite after the conversion
        w = w.clamp(-6e4, 6e4).to(dtype) if dtype == torch.float16 else w.clamp(-3.3e38, 3.3e38).to(dtype)
    table = random_table(gen)
    args = dict(variant=variant, threads=threads)
    if kind == "valid":
        packed, scale = native.s3d8_encode(layout(data, w, "weight"), layout(data, table, "table"), **args)
        ref_packed, ref_scale = s3d8.encode(w, table)
        assert same_bits(scale, ref_scale)
        # A row whose scale underflows to 0 (0 < absmax < ~5.8e-39) decodes to 0 whatever its bytes;
        # the native encoder encodes it like a zero row so that it cannot disturb the centroid its
        # group shares. (The Python reference turns its 0 / 0 into index 32, a corrupt byte.)
        under = (ref_scale.float().flatten() == 0) & (w.float().abs().amax(dim=1) > 0)
        if bool(under.any()):
            ref_packed, _ = s3d8.encode(torch.where(under[:, None], torch.zeros_like(w), w), table)
        assert torch.equal(packed, ref_packed)
        return
    bad_w, bad_t = w, table
    if kind == "weight_nonfinite":
        bad_w = w.clone()
        bad_w[data.draw(st.integers(0, d_out - 1)), data.draw(st.integers(0, d_in - 1))] = \
            data.draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]))
    elif kind == "weight_dtype":
        bad_w = data.draw(st.sampled_from([w.double(), w.to(torch.int8), w.view(torch.int16) if w.element_size() == 2
                                           else w.view(torch.int32)]))
    elif kind == "weight_dims":
        bad_w = data.draw(st.sampled_from([w.flatten(), w.reshape(1, d_out, d_in)]))
    elif kind == "weight_empty":
        bad_w = torch.zeros(0, d_in)
    elif kind == "table_negative":
        bad_t = table.clone()
        bad_t[data.draw(st.integers(0, 31)), data.draw(st.integers(0, 2))] = data.draw(st.integers(-128, -1))
    elif kind == "table_shape":
        bad_t = table.flatten()
    elif kind == "table_dtype":
        bad_t = table.float()
    elif kind == "threads":
        args["threads"] = bad_threads(data)
    elif kind == "variant":
        args["variant"] = bad_variant(data)
    names = {"threads": "threads", "variant": "variant"}.get(kind, "table" if kind.startswith("table") else "weight")
    expect_value_error(lambda: native.s3d8_encode(bad_w, bad_t, **args), names)


@FUZZ
@given(st.data())
def test_fuzz_bf16_matmul(data):
    """The float baseline: contract errors, and finite input close to float64 (not bit-exact by design)."""
    kind = draw_kind(data, "bf16_matmul", ["x_dtype", "x_last_dim", "weight_dtype", "weight_dims",
                                           "weight_empty", "threads", "variant"])
    gen = gen_of(data)
    variant = data.draw(st.sampled_from(VARIANTS), label="variant")
    d_out, d_in, m = (data.draw(st.integers(1, 30)), data.draw(st.integers(1, 100)), data.draw(st.integers(0, 6)))
    x = torch.randn(m, d_in, generator=gen)
    w = torch.randn(d_out, d_in, generator=gen).to(torch.bfloat16)
    args = dict(variant=variant, threads=data.draw(st.integers(1, 3)))
    if kind == "valid":
        got = native.bf16_matmul(layout(data, x, "x"), layout(data, w, "weight"), **args)
        expected = x.double() @ w.double().T
        assert torch.allclose(got.double(), expected, rtol=1e-4, atol=1e-4)
        return
    bad_x, bad_w = x, w
    if kind == "x_dtype":
        bad_x = x.double()
    elif kind == "x_last_dim":
        bad_x = torch.zeros(1, d_in + 1)
    elif kind == "weight_dtype":
        bad_w = data.draw(st.sampled_from([w.float(), w.view(torch.int16), w.half()]))
    elif kind == "weight_dims":
        bad_w = w.flatten()
    elif kind == "weight_empty":
        bad_w, bad_x = torch.zeros(d_out, 0, dtype=torch.bfloat16), torch.zeros(m, 0)
    elif kind == "threads":
        args["threads"] = bad_threads(data)
    elif kind == "variant":
        args["variant"] = bad_variant(data)
    names = {"x_dtype": "x", "x_last_dim": "x", "threads": "threads", "variant": "variant"}.get(kind, "weight")
    expect_value_error(lambda: native.bf16_matmul(bad_x, bad_w, **args), names)


@FUZZ
@given(st.data())
def test_fuzz_s3d8_linear(data):
    kind = draw_kind(data, "S3D8Linear", ["packed_size", "scale_count", "table_negative", "bias_size",
                                          "bias_dtype", "k_too_large", "x_dtype", "x_last_dim"])
    gen = gen_of(data)
    d_out = data.draw(st.integers(1, 30), label="d_out")
    d_in = _k_over(data, native.K_MAX) if kind == "k_too_large" else data.draw(st.integers(1, 100), label="d_in")
    packed, scale, table = random_packed(d_out, d_in, gen), random_scale(data, d_out, gen), random_table(gen)
    bias = torch.randn(d_out, generator=gen) if data.draw(st.booleans(), label="bias") else None
    m = data.draw(st.integers(0, 20), label="m")
    x = floats(data, (m, d_in), gen) if kind != "k_too_large" else None
    if kind == "valid":
        dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), label="x dtype")
        x = x.to(dtype)
        layer = native.S3D8Linear(layout(data, packed, "packed"), scale, table, (d_out, d_in), bias=bias)
        got = layer(layout(data, x, "x"))
        expected = native.s3d8_matmul(x.float(), packed, scale, table, (d_out, d_in), variant="scalar")
        if bias is not None:
            expected += bias
        assert same_bits(got, expected.to(dtype))
        return
    if kind in ("x_dtype", "x_last_dim"):
        layer = native.S3D8Linear(packed, scale, table, (d_out, d_in), bias=bias)
        bad = x.to(torch.int32) if kind == "x_dtype" else torch.zeros(1, d_in + 1)
        expect_value_error(lambda: layer(bad), "x")
        return
    names = {"packed_size": "packed", "scale_count": "scale", "table_negative": "table",
             "bias_size": "bias", "bias_dtype": "bias", "k_too_large": "shape"}[kind]
    if kind == "packed_size":
        packed = torch.zeros(packed.numel() + 16, dtype=torch.uint8)
    elif kind == "scale_count":
        scale = torch.ones(d_out + 1, 1, dtype=torch.bfloat16)
    elif kind == "table_negative":
        table[data.draw(st.integers(0, 31)), data.draw(st.integers(0, 2))] = data.draw(st.integers(-128, -1))
    elif kind == "bias_size":
        bias = torch.zeros(d_out + 1)
    elif kind == "bias_dtype":
        bias = torch.zeros(d_out, dtype=torch.int64)
    expect_value_error(lambda: native.S3D8Linear(packed, scale, table, (d_out, d_in), bias=bias), names)
