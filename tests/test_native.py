"""The native kernel library against the Python reference, bit for bit, for every variant."""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline import native
from pipeline.formats import s3d8
from pipeline.quant import int8_activations, int8_matmul_reference

VARIANTS = native.available_variants()
# More threads than cores (the tests use 3): OpenMP threads must sleep, not spin, at barriers.
PROGRAM_ENV = dict(os.environ, OMP_WAIT_POLICY="passive")
# (d_out, d_in): d_out not a multiple of 3, d_in not a multiple of 16 or 64, tiles with a remainder
SHAPES = [(1, 1), (2, 17), (4, 16), (7, 33), (9, 64), (13, 65), (48, 100), (101, 130), (389, 47)]


def load_build_script():
    spec = importlib.util.spec_from_file_location("s3d8_native_build", Path(__file__).parents[1] / "native" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def native_program(tmp_path_factory):
    """Build a standalone program from native/ for this machine (once per name and flags)."""
    build, built = load_build_script(), {}

    def get(name: str, sanitize: str | None = None) -> Path:
        key = (name, sanitize)
        if key not in built:
            out = tmp_path_factory.mktemp(f"{name}-{sanitize or 'plain'}") / name
            built[key] = build.build_program(name, out=out, sanitize=sanitize)
        return built[key]

    return get


def random_s3d8(d_out: int, d_in: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(d_out, d_in, generator=gen)
    w[d_out // 2] = 0.0                                    # an all-zero channel
    table = torch.randint(0, 128, (32, 3), dtype=torch.int8, generator=gen)
    table[0] = 127                                         # extreme weights +-127
    packed, scale = s3d8.encode(w, table)
    return w, packed, scale, table


def activations(m: int, d_in: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d_in, generator=gen) * 4
    if m > 1:
        x[1] = 0.0                                         # zero token: scale 1
    if m > 2:
        x[2] = torch.where(torch.arange(d_in) % 2 == 0, 1e5, -1e5)  # extreme +-127
    if m > 3:
        x[3] = torch.arange(d_in, dtype=torch.float32) * 0.5 - 3.0  # many ties at .5
    return x


def test_variants_reported():
    assert VARIANTS[0] == "scalar"
    assert native.variant() in VARIANTS
    assert set(VARIANTS) <= set(native.compiled_variants())


def test_environment_forces_variant(monkeypatch):
    monkeypatch.setenv("S3D8_VARIANT", "scalar")
    assert native.variant() == "scalar"
    monkeypatch.setenv("S3D8_VARIANT", "no-such-isa")
    with pytest.raises(ValueError, match="S3D8_VARIANT"):
        native.variant()


def _prefetch_in_fresh_process(value: str | None) -> str:
    """``native.next_block_prefetch()`` in a new interpreter (the library chooses when it loads)."""
    env = {k: v for k, v in os.environ.items() if k != "S3D8_NEXT_PREFETCH"}
    if value is not None:
        env["S3D8_NEXT_PREFETCH"] = value
    out = subprocess.run([sys.executable, "-c", "from pipeline import native; print(native.next_block_prefetch())"],
                         capture_output=True, text=True, env=env, cwd=Path(__file__).parents[1], timeout=120)
    return out.stdout.strip() if out.returncode == 0 else out.stderr


def test_environment_chooses_the_next_block_prefetch(monkeypatch):
    """The one-token S3D8 products prefetch into L1 on AMD CPUs and L2 on the others unless S3D8_NEXT_PREFETCH says;
    Arm has no such choice."""
    if platform.machine() not in ("x86_64", "AMD64"):
        assert native.next_block_prefetch() is None
        return
    amd = "AuthenticAMD" in Path("/proc/cpuinfo").read_text()
    loaded = native.next_block_prefetch()
    assert _prefetch_in_fresh_process(None) == ("l1" if amd else "l2")
    assert _prefetch_in_fresh_process("l1") == "l1"
    assert _prefetch_in_fresh_process("l2") == "l2"
    assert "S3D8_NEXT_PREFETCH='L3': expected l1 or l2" in _prefetch_in_fresh_process("L3")
    monkeypatch.setenv("S3D8_NEXT_PREFETCH", "l1" if loaded == "l2" else "l2")
    assert native.next_block_prefetch() == loaded       # chosen when the library loads, not at each call


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_matches_reference(variant, shape):
    _, packed, _, table = random_s3d8(*shape)
    expected = s3d8.decode_int8(packed, table, shape)
    for threads in (1, 3):
        got = native.s3d8_decode_int8(packed, table, shape, variant=variant, threads=threads)
        assert got.dtype == torch.int8 and got.shape == shape
        assert torch.equal(got, expected)
    assert torch.equal(native.s3d8_decode_int8(packed.flatten(), table, shape, variant=variant), expected)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_matmul_matches_reference(variant, shape):
    d_out, d_in = shape
    _, packed, scale, table = random_s3d8(*shape)
    w_int8 = s3d8.decode_int8(packed, table, shape).contiguous()
    for m in (1, 2, 3, 4, 5, 8, 17):
        x = activations(m, d_in, seed=m)
        xq, x_scale = int8_activations(x)
        expected = int8_matmul_reference(xq, x_scale, w_int8, scale)
        for path in native.PATHS:
            for threads in (1, 3):
                got = native.s3d8_matmul(x, packed, scale, table, shape, variant=variant,
                                         threads=threads, path=path)
                assert got.dtype == torch.float32 and got.shape == (m, d_out)
                assert torch.equal(got, expected), (m, path, threads)
        for path in ("fused", "torch"):
            got = native.int8_matmul(x, w_int8, scale, variant=variant, path=path)
            assert torch.equal(got, expected), (m, path, "int8")


@pytest.mark.parametrize("variant", VARIANTS)
def test_default_path_for_large_m(variant):
    shape = (50, 70)
    _, packed, scale, table = random_s3d8(*shape)
    x = activations(40, 70)
    xq, x_scale = int8_activations(x)
    expected = int8_matmul_reference(xq, x_scale, s3d8.decode_int8(packed, table, shape).contiguous(), scale)
    assert torch.equal(native.s3d8_matmul(x, packed, scale, table, shape, variant=variant), expected)
    assert torch.equal(native.s3d8_matmul(x.reshape(4, 10, 70), packed, scale, table, shape,
                                          variant=variant).reshape(40, 50), expected)


@pytest.mark.parametrize("variant", VARIANTS)
def test_quantize_activations_matches_reference(variant):
    for m, k in [(1, 1), (5, 17), (6, 130), (3, 1000)]:
        x = activations(m, k, seed=k)
        xq, scale = int8_activations(x)
        got_q, got_scale = native.quantize_activations(x, variant=variant)
        assert torch.equal(got_q, xq) and torch.equal(got_scale, scale)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_encode_matches_reference(variant, shape):
    w, packed, scale, table = random_s3d8(*shape)
    for threads in (1, 2, 5):
        got_packed, got_scale = native.s3d8_encode(w, table, threads=threads, variant=variant)
        assert got_packed.dtype == torch.uint8 and got_scale.dtype == torch.bfloat16
        assert torch.equal(got_packed, packed) and torch.equal(got_scale, scale)


@pytest.mark.parametrize("variant", VARIANTS)
def test_encode_bf16_weight_and_fitted_table(variant):
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(31, 90, generator=gen) * 0.02).to(torch.bfloat16)
    w[5, :] = 0
    w[7, 3] = -0.0
    w[9, :] = w[8, :]                                     # equal rows: ties between centroids
    table = s3d8.fit_centroids(w)
    table[5] = table[4]                                    # duplicate centroid: ties go to the lower index
    packed, scale = s3d8.encode(w, table)
    got_packed, got_scale = native.s3d8_encode(w, table, variant=variant)
    assert torch.equal(got_packed, packed) and torch.equal(got_scale, scale)


@pytest.mark.parametrize("variant", VARIANTS)
def test_bf16_matmul_close_to_torch(variant):
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(37, 75, generator=gen).to(torch.bfloat16)
    x = torch.randn(3, 75, generator=gen)
    expected = x.double() @ w.double().T
    got = native.bf16_matmul(x, w, variant=variant)
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-4)


def test_linear_module():
    shape = (10, 40)
    _, packed, scale, table = random_s3d8(*shape)
    bias = torch.randn(10)
    layer = native.S3D8Linear(packed.flatten(), scale, table, shape, bias=bias)
    x = torch.randn(2, 3, 40)
    expected = native.s3d8_matmul(x, packed, scale, table, shape) + bias
    assert torch.equal(layer(x), expected)
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["s3d8", "int8", "bf16"])
def test_linear_modules_hot_path_equals_the_checked_functions(kind):
    """The modules' decode hot path (plain float32 tokens, checks skipped) gives the functions' bits; other
    inputs (1-D, strided, bf16, more tokens than the fused kernel takes) go through the checked functions."""
    d_out, d_in = 10, 40
    w, packed, scale, table = random_s3d8(d_out, d_in)
    if kind == "s3d8":
        layer = native.S3D8Linear(packed, scale, table, (d_out, d_in))
        ref = lambda x: native.s3d8_matmul(x, packed, scale, table, (d_out, d_in))  # noqa: E731
    elif kind == "int8":
        w8 = torch.randint(-127, 128, (d_out, d_in), generator=torch.Generator().manual_seed(1), dtype=torch.int8)
        layer = native.Int8Linear(w8, scale)
        ref = lambda x: native.int8_matmul(x, w8, scale)  # noqa: E731
    else:
        wb = w.to(torch.bfloat16)
        layer = native.Bf16Linear(wb)
        ref = lambda x: native.bf16_matmul(x, wb)  # noqa: E731
    gen = torch.Generator().manual_seed(2)
    for x in (torch.randn(1, d_in, generator=gen), torch.randn(d_in, generator=gen),
              torch.randn(2, 3, d_in, generator=gen), torch.randn(d_in, 5, generator=gen).t(),
              torch.randn(native.FUSED_MAX_M + 4, d_in, generator=gen)):
        got = layer(x)
        assert got.shape == (*x.shape[:-1], d_out) and got.dtype == torch.float32
        assert torch.equal(got, ref(x.contiguous()))
    xb = torch.randn(3, d_in, generator=gen).to(torch.bfloat16)
    assert torch.equal(layer(xb), ref(xb.float()).to(torch.bfloat16))
    with pytest.raises(ValueError, match=f"x: expected float32 \\[m, {d_in}\\]"):
        layer(torch.randn(2, d_in + 1))


def test_bad_input_raises_clear_errors():
    shape = (7, 33)
    _, packed, scale, table = random_s3d8(*shape)
    x = torch.randn(2, 33)
    with pytest.raises(ValueError, match="packed: expected dtype torch.uint8"):
        native.s3d8_decode_int8(packed.to(torch.int8), table, shape)
    with pytest.raises(ValueError, match=r"needs \[3, 48\] = 144 bytes"):
        native.s3d8_decode_int8(packed[:, :32].contiguous(), table, shape)
    with pytest.raises(ValueError, match=r"needs \[4, 48\]"):
        native.s3d8_matmul(x, packed, scale, table, (10, 33))
    with pytest.raises(ValueError, match="out: expected a contiguous tensor"):
        native.s3d8_decode_int8(packed, table, shape, out=torch.empty(33, 7, dtype=torch.int8).T)
    with pytest.raises(ValueError, match="x: expected dtype torch.float32"):
        native.s3d8_matmul(x.double(), packed, scale, table, shape)
    with pytest.raises(ValueError, match=r"x: expected float32 \[m, 33\]"):
        native.s3d8_matmul(torch.randn(2, 32), packed, scale, table, shape)
    with pytest.raises(ValueError, match="scale: expected dtype torch.bfloat16"):
        native.s3d8_matmul(x, packed, scale.float(), table, shape)
    with pytest.raises(ValueError, match="scale: expected 7 channel scales"):
        native.s3d8_matmul(x, packed, scale[:6].contiguous(), table, shape)
    with pytest.raises(ValueError, match=r"table: expected shape \[32, 3\]"):
        native.s3d8_matmul(x, packed, scale, table[:31].contiguous(), shape)
    with pytest.raises(ValueError, match="table: expected dtype torch.int8"):
        native.s3d8_decode_int8(packed, table.float(), shape)
    with pytest.raises(ValueError, match="shape"):
        native.s3d8_decode_int8(packed, table, (7, 0))
    with pytest.raises(ValueError, match="variant 'sse9' is not available"):
        native.s3d8_matmul(x, packed, scale, table, shape, variant="sse9")
    with pytest.raises(ValueError, match="threads"):
        native.s3d8_matmul(x, packed, scale, table, shape, threads=0)
    with pytest.raises(ValueError, match="path"):
        native.s3d8_matmul(x, packed, scale, table, shape, path="magic")
    with pytest.raises(ValueError, match="weight: expected dtype torch.int8"):
        native.int8_matmul(x, torch.zeros(7, 33), scale)
    with pytest.raises(ValueError, match="weight: expected a floating-point"):
        native.s3d8_encode(torch.zeros(7, 33, dtype=torch.int8), table)
    with pytest.raises(ValueError, match="weight: expected 2 dimensions"):
        native.s3d8_encode(torch.zeros(7, 33, 2), table)


def test_native_selftest_all_variants(native_program):
    """The C driver: every variant against the scalar reference, 1 and 3 threads, m = 1..17."""
    out = subprocess.run([str(native_program("s3d8_selftest"))], capture_output=True, text=True,
                         timeout=120, env=PROGRAM_ENV)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ALL OK" in out.stdout


def test_selftest_under_address_sanitizer(native_program):
    """The scalar reference (and every SIMD variant) on odd shapes, exact-size buffers, under ASan + UBSan."""
    exe = native_program("s3d8_selftest", sanitize="address,undefined")
    out = subprocess.run([str(exe), "--quick"], capture_output=True, text=True, timeout=300,
                         env=dict(PROGRAM_ENV, ASAN_OPTIONS="detect_leaks=1", UBSAN_OPTIONS="halt_on_error=1"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK scalar" in out.stdout and "ALL OK" in out.stdout


def test_bench_program_runs_tiny_shapes(native_program):
    exe = native_program("s3d8_bench")
    out = subprocess.run([str(exe), "--shapes", "1x64x48,5x100x31,20x70x9", "--rotate-mb", "1",
                          "--repeats", "1"], capture_output=True, text=True, timeout=120, env=PROGRAM_ENV)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 9 and all("check=ok" in line for line in lines)
    assert all(f"variant={native.variant()}" in line for line in lines)


# ---- Non-finite values, contracts checked before C (issue 12) ---------------------------------

def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and identical bits: NaN positions and payloads included."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.int32 if a.element_size() == 4 else torch.int16),
        b.contiguous().view(torch.int32 if b.element_size() == 4 else torch.int16))


def nonfinite_inputs(m: int, d_in: int, d_out: int, seed: int = 5):
    """x with NaN/Inf tokens (first, middle, last position) and scales with NaN/Inf channels."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d_in, generator=gen) * 3
    bad_rows = torch.zeros(m, dtype=torch.bool)
    for i in range(m):
        kind = i % 5
        if kind == 0:
            x[i, i % d_in] = float("nan")
        elif kind == 1:
            x[i, d_in - 1] = float("inf")
        elif kind == 2:
            x[i, 0] = -float("inf")
        elif kind == 4:
            x[i, 0], x[i, d_in // 2] = 1e38, float("nan")
        bad_rows[i] = kind != 3
    _, packed, scale, table = random_s3d8(d_out, d_in, seed=seed)
    bad_cols = torch.arange(d_out) % 4 == 1
    for j, c in enumerate(bad_cols.nonzero().flatten().tolist()):
        scale[c] = [float("nan"), float("inf"), -float("inf")][j % 3]
    return x, packed, scale, table, bad_rows, bad_cols


@pytest.mark.parametrize("variant", VARIANTS)
def test_nonfinite_policy_all_paths_bit_for_bit(variant):
    """A token with NaN/Inf gives an all-NaN row, a NaN/Inf channel scale a NaN column: the same
    bits (0x7FC00000) as the Python reference, on every path and thread count."""
    d_out, d_in = 13, 70
    for m in (1, 6, 20):
        x, packed, scale, table, bad_rows, bad_cols = nonfinite_inputs(m, d_in, d_out, seed=m)
        w_int8 = s3d8.decode_int8(packed, table, (d_out, d_in)).contiguous()
        xq, x_scale = int8_activations(x)
        assert torch.equal(xq[bad_rows], torch.zeros_like(xq[bad_rows]))
        assert torch.isnan(x_scale[bad_rows]).all() and not torch.isnan(x_scale[~bad_rows]).any()
        expected = int8_matmul_reference(xq, x_scale, w_int8, scale)
        nan_mask = bad_rows[:, None] | bad_cols[None, :]
        assert torch.equal(torch.isnan(expected), nan_mask)
        got_q, got_scale = native.quantize_activations(x, variant=variant)
        assert torch.equal(got_q, xq) and same_bits(got_scale, x_scale)
        for path in native.PATHS:
            for threads in (1, 3):
                got = native.s3d8_matmul(x, packed, scale, table, (d_out, d_in), variant=variant,
                                         threads=threads, path=path)
                assert same_bits(got, expected), (m, path, threads)
        for path in ("fused", "torch"):
            got = native.int8_matmul(x, w_int8, scale, variant=variant, path=path)
            assert same_bits(got, expected), (m, path, "int8")


def test_nonfinite_finite_input_unchanged():
    """The policy touches nothing finite: a finite batch gives no NaN anywhere."""
    _, packed, scale, table = random_s3d8(13, 70)
    y = native.s3d8_matmul(activations(9, 70), packed, scale, table, (13, 70))
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("variant", VARIANTS)
def test_int8_weight_minus_128_is_exact(variant):
    """-128 weights (sign-epi8 overflow in AVX2 before issue 12) equal the int32 reference."""
    gen = torch.Generator().manual_seed(7)
    for d_out, d_in in [(5, 31), (9, 64), (4, 200)]:
        w = torch.randint(-128, 128, (d_out, d_in), dtype=torch.int8, generator=gen)
        w[0] = -128
        scale = (torch.rand(d_out, 1, generator=gen) + 0.5).to(torch.bfloat16)
        for m in (1, 5, 17):
            x = activations(m, d_in, seed=m)
            x[0] = -1e4                                    # -127 times -128: the overflowing pair
            xq, x_scale = int8_activations(x)
            expected = int8_matmul_reference(xq, x_scale, w, scale)
            for path in ("fused", "torch"):
                assert torch.equal(native.int8_matmul(x, w, scale, variant=variant, path=path), expected)


def test_k_bound_is_exact():
    assert 127 * 127 * native.K_MAX < 2 ** 31 <= 127 * 127 * (native.K_MAX + 1)
    assert 128 * 127 * native.K_MAX_INT8_FULL < 2 ** 31 <= 128 * 127 * (native.K_MAX_INT8_FULL + 1)


@pytest.mark.parametrize("variant", VARIANTS)
def test_k_at_the_bound_is_exact_and_beyond_refused(variant):
    k = native.K_MAX
    x = torch.full((2, k), 1000.0)
    x[1] = -1000.0                                         # +-127 after quantisation
    table = torch.zeros(32, 3, dtype=torch.int8)
    table[0] = 127
    packed = torch.zeros(1, _pad16(k), dtype=torch.uint8)  # q = 0, positive signs: w = +127
    scale = torch.full((3, 1), 1 / 64, dtype=torch.bfloat16)
    xq, x_scale = int8_activations(x)
    w = torch.full((3, k), 127, dtype=torch.int8)
    expected = int8_matmul_reference(xq, x_scale, w, scale)
    acc = torch.tensor([[127 * 127 * k], [-127 * 127 * k]], dtype=torch.int64).float()  # no wrap
    assert torch.equal(expected, (acc * x_scale.float() * scale.float().reshape(1, -1)))
    for path in native.PATHS:
        assert torch.equal(native.s3d8_matmul(x, packed, scale, table, (3, k), variant=variant, path=path), expected)
    for path in ("fused", "torch"):
        assert torch.equal(native.int8_matmul(x, w, scale, variant=variant, path=path), expected)
    # INT8 weights of -128: exact at K_MAX_INT8_FULL, refused above it
    k8 = native.K_MAX_INT8_FULL
    w8 = torch.full((3, k8), -128, dtype=torch.int8)
    x8 = x[:, :k8].contiguous()
    xq8, xs8 = int8_activations(x8)
    assert torch.equal(native.int8_matmul(x8, w8, scale, variant=variant),
                       int8_matmul_reference(xq8, xs8, w8, scale))
    w8 = torch.full((3, k8 + 1), -128, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"weight \(holds -128\): d_in = 132,?105 exceeds 132,104"):
        native.int8_matmul(x[:, :k8 + 1].contiguous(), w8, scale, variant=variant)
    with pytest.raises(ValueError, match=r"weight \(holds -128\): d_in = 132,?105 exceeds 132,104"):
        native.Int8Linear(w8, scale)
    assert native.Int8Linear(torch.zeros(3, k8 + 1, dtype=torch.int8), scale).in_features == k8 + 1  # no -128
    # one more input than K_MAX: refused before C
    x1 = torch.zeros(1, k + 1)
    with pytest.raises(ValueError, match="shape: d_in = 133145 exceeds 133,144"):
        native.s3d8_matmul(x1, torch.zeros(1, _pad16(k + 1), dtype=torch.uint8), scale, table, (3, k + 1),
                           variant=variant)
    with pytest.raises(ValueError, match="weight: d_in = 133145 exceeds 133,144"):
        native.int8_matmul(x1, torch.zeros(3, k + 1, dtype=torch.int8), scale, variant=variant)


def _pad16(k: int) -> int:
    return -(-k // 16) * 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_encode_rejects_nonfinite_weights(dtype, bad):
    w, _, _, table = random_s3d8(7, 33)
    w = w.to(dtype)
    w[4, 20] = bad
    with pytest.raises(ValueError, match=r"weight: 1 non-finite value\(s\).* at \[4, 20\]"):
        native.s3d8_encode(w, table)


def test_negative_table_is_refused_everywhere():
    shape = (7, 33)
    w, packed, scale, table = random_s3d8(*shape)
    table[3, 1] = -5
    match = r"table: centroid values must lie in \[0, 127\], got (a minimum of -5|a negative value)"
    with pytest.raises(ValueError, match=match):
        native.s3d8_decode_int8(packed, table, shape)
    for path in (None, *native.PATHS):
        for variant in VARIANTS:
            with pytest.raises(ValueError, match=match):
                native.s3d8_matmul(torch.randn(2, 33), packed, scale, table, shape, path=path, variant=variant)
    with pytest.raises(ValueError, match=match):
        native.s3d8_encode(w, table)
    with pytest.raises(ValueError, match=match):
        native.S3D8Linear(packed, scale, table, shape)


def test_strided_and_relabelled_inputs_are_copied():
    """Inputs that C could not read as they are (transposed, sliced, expanded, a lazy negation)
    are copied: the result equals that of the plain tensor."""
    shape = (7, 33)
    w, packed, scale, table = random_s3d8(*shape)
    x = torch.randn(3, 33)
    expected = native.s3d8_matmul(x, packed, scale, table, shape)
    assert torch.equal(native.s3d8_matmul(x.T.contiguous().T, packed, scale, table, shape), expected)
    wide = torch.zeros(packed.shape[0], packed.shape[1] * 2, dtype=torch.uint8)
    wide[:, ::2] = packed
    assert torch.equal(native.s3d8_matmul(x, wide[:, ::2], scale, table, shape), expected)
    assert torch.equal(native.s3d8_matmul(x, packed, scale.T.contiguous().T, table.T.contiguous().T, shape), expected)
    neg = torch._neg_view(-x)
    assert neg.is_neg()
    assert torch.equal(native.s3d8_matmul(neg, packed, scale, table, shape), expected)
    row = torch.randn(1, 33)
    assert torch.equal(native.s3d8_matmul(row.expand(4, 33), packed, scale, table, shape),
                       native.s3d8_matmul(row.repeat(4, 1), packed, scale, table, shape))
    w8 = s3d8.decode_int8(packed, table, shape).contiguous()
    assert torch.equal(native.int8_matmul(x, w8.T.contiguous().T, scale), native.int8_matmul(x, w8, scale))
    assert torch.equal(native.s3d8_decode_int8(wide[:, ::2], table, shape), w8)
    p1, s1 = native.s3d8_encode(w.T.contiguous().T, table)
    p2, s2 = native.s3d8_encode(torch._neg_view(-w), table)
    assert torch.equal(p1, packed) and torch.equal(s1, scale) and torch.equal(p2, packed)
    q1, _ = native.quantize_activations(x[:, ::1].T.contiguous().T)
    assert torch.equal(q1, int8_activations(x)[0])


def test_bad_arguments_are_value_errors():
    shape = (7, 33)
    _, packed, scale, table = random_s3d8(*shape)
    x = torch.randn(2, 33)
    out = torch.empty(7, 33, dtype=torch.int8)
    buf = torch.zeros(400, dtype=torch.uint8)
    buf[:144] = packed.flatten()
    with pytest.raises(ValueError, match="out: must not overlap an input"):
        native.s3d8_decode_int8(buf[:144], table, shape, out=buf[100:331].view(torch.int8).view(7, 33))
    with pytest.raises(ValueError, match="out: expected a plain tensor"):
        native.s3d8_decode_int8(packed, table, shape, out=torch._neg_view(out))
    with pytest.raises(ValueError, match=r"out: expected torch.int8 \[7, 33\]"):
        native.s3d8_decode_int8(packed, table, shape, out=torch.empty(7, 32, dtype=torch.int8))
    for threads in (0, -1, 1025, True, 2.0, "2"):
        with pytest.raises(ValueError, match="threads"):
            native.s3d8_matmul(x, packed, scale, table, shape, threads=threads)
    with pytest.raises(ValueError, match="variant: expected a variant name"):
        native.s3d8_matmul(x, packed, scale, table, shape, variant=3)
    for bad_shape in [(7.0, 33), (7, 33.5), (True, 33), (7,), "7x33", None, (7, 33, 1)]:
        with pytest.raises(ValueError, match="shape"):
            native.s3d8_decode_int8(packed, table, bad_shape)
    assert torch.equal(native.s3d8_decode_int8(packed, table, (torch.tensor(7), 33)),
                       native.s3d8_decode_int8(packed, table, shape))
    with pytest.raises(ValueError, match="x: expected a dense"):
        native.s3d8_matmul(x.to_sparse(), packed, scale, table, shape)
    with pytest.raises(ValueError, match="x: expected a CPU tensor"):
        native.s3d8_matmul(x.to("meta"), packed, scale, table, shape)
    with pytest.raises(ValueError, match="scale: expected dtype torch.bfloat16, got torch.int16"):
        native.s3d8_matmul(x, packed, scale.view(torch.int16), table, shape)
    with pytest.raises(ValueError, match="packed: expected dtype torch.uint8, got torch.int8"):
        native.s3d8_matmul(x, packed.view(torch.int8), scale, table, shape)
    with pytest.raises(ValueError, match="weight: expected dtype torch.int8, got torch.uint8"):
        native.int8_matmul(x, torch.zeros(7, 33, dtype=torch.uint8), scale)
    with pytest.raises(ValueError, match="weight: expected positive sizes"):
        native.int8_matmul(torch.randn(2, 0), torch.zeros(7, 0, dtype=torch.int8), scale)
    with pytest.raises(ValueError, match="k >= 1"):
        native.quantize_activations(torch.randn(2, 0))
    with pytest.raises(ValueError, match="weight: expected dtype torch.float32, got torch.float64"):
        native.s3d8_encode(torch.zeros(7, 33, dtype=torch.float64), table)
    with pytest.raises(ValueError, match="bias: expected a floating-point tensor of 7 values"):
        native.S3D8Linear(packed, scale, table, shape, bias=torch.zeros(6))
    with pytest.raises(ValueError, match="x: expected a floating-point tensor"):
        native.S3D8Linear(packed, scale, table, shape)(torch.ones(2, 33, dtype=torch.int64))


@pytest.mark.parametrize("variant", VARIANTS)
def test_torch_path_with_one_input(variant):
    """d_in = 1 on the torch._int_mm path: torch misreads the [1, n] operand with strides (1, 1)
    (wrong sums for n > 1, found by the fuzz tests); the library passes unambiguous strides."""
    gen = torch.Generator().manual_seed(11)
    for d_out in (2, 5, 40):
        w = torch.randint(-128, 128, (d_out, 1), dtype=torch.int8, generator=gen)
        scale = (torch.rand(d_out, 1, generator=gen) + 0.5).to(torch.bfloat16)
        _, packed, s_scale, table = random_s3d8(d_out, 1)
        for m in (1, 3, 20):
            x = torch.randn(m, 1, generator=gen)
            xq, xs = int8_activations(x)
            assert torch.equal(native.int8_matmul(x, w, scale, variant=variant, path="torch"),
                               int8_matmul_reference(xq, xs, w, scale))
            expected = int8_matmul_reference(xq, xs, s3d8.decode_int8(packed, table, (d_out, 1)), s_scale)
            assert torch.equal(native.s3d8_matmul(x, packed, s_scale, table, (d_out, 1), variant=variant,
                                                  path="torch"), expected)


@pytest.mark.parametrize("variant", VARIANTS)
def test_encode_row_with_a_tiny_absmax(variant):
    """A row with 0 < absmax / 127 < 2^-126 gets the smallest normal scale 2^-126 (SPEC section 1), never 0;
    native and Python encoders agree on it and on the neighbours sharing its bytes."""
    w, _, _, table = random_s3d8(9, 40)
    w[3] = 0.0
    w[3, 5], w[3, 7] = 1e-40, -1e-45
    packed, scale = native.s3d8_encode(w, table, variant=variant)
    ref_packed, ref_scale = s3d8.encode(w, table)
    assert float(scale[3]) == 2.0 ** -126 and torch.equal(scale, ref_scale)
    assert torch.equal(packed, ref_packed)
    decoded = s3d8.decode(packed, scale, table, (9, 40))
    assert decoded[3].abs().max() <= 127 * 2.0 ** -126


def _tuning_case(monkeypatch, int_mm_fast: bool):
    """A product above FUSED_MAX_M tokens, tuning on, torch._int_mm fast or not: ``(s3d8 run, int8 run, expected)``."""
    monkeypatch.setattr(native, "_INT_MM_FAST", int_mm_fast)
    monkeypatch.setattr(native, "_AMX", False)
    monkeypatch.setattr(native, "TUNE", True)
    monkeypatch.setattr(native, "_tuned", {})
    shape = (96, 160)
    _, packed, scale, table = random_s3d8(*shape)
    w_int8 = s3d8.decode_int8(packed, table, shape).contiguous()
    x = activations(40, shape[1], seed=3)
    xq, x_scale = int8_activations(x)
    return (lambda: native.s3d8_matmul(x, packed, scale, table, shape),
            lambda: native.int8_matmul(x, w_int8, scale), int8_matmul_reference(xq, x_scale, w_int8, scale))


def test_no_torch_int_mm_without_vnni(monkeypatch):
    """Without VNNI or AMX (torch._int_mm then runs a generic ~1 GMAC/s path) the library's kernels take every
    size: no tuning, and the fixed rule never picks torch, however many tokens or inputs."""
    run_s3d8, run_int8, expected = _tuning_case(monkeypatch, int_mm_fast=False)
    assert native._choose_path(None, 4 * native.TORCH_MIN_M, 2 * native.TORCH_MIN_K) == "tiled"
    assert native._choose_path(None, 1, 64) == "fused"
    assert torch.equal(run_s3d8(), expected) and torch.equal(run_int8(), expected)
    assert native._tuned == {}


@pytest.mark.parametrize("op", ["s3d8", "int8"])
def test_path_tuning_changes_speed_not_bits(monkeypatch, op):
    """Above FUSED_MAX_M tokens (VNNI without AMX) the first product of a size class times the library's INT8 GEMM
    (s3d8_matmul: tiled; int8_matmul: fused) and torch's and keeps the faster; both give the reference's bits, so
    whichever wins, the result is the same. (Run on any CPU: torch._int_mm is slow without VNNI, not wrong.)"""
    run_s3d8, run_int8, expected = _tuning_case(monkeypatch, int_mm_fast=True)
    run = run_s3d8 if op == "s3d8" else run_int8
    assert torch.equal(run(), expected)
    assert list(native._tuned.values())[0] in (("tiled", "torch") if op == "s3d8" else ("fused", "torch"))
    assert (list(native._tuned)[0][0] == "int8") == (op == "int8") and len(native._tuned) == 1
    assert torch.equal(run(), expected)                   # the tuned path
    assert len(native._tuned) == 1


def _declarations(text: str) -> dict[str, str]:
    """``{function name: its prototype with whitespace normalised}`` of the C declarations in ``text``."""
    import re

    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    found = {}
    for m in re.finditer(r"(?:^|[;}\n])\s*((?:static\s+)?(?:const\s+)?[A-Za-z_][\w\s\*]*?\b(s3d8_\w+)\s*\([^;{)]*\))\s*[;{]",
                         text):
        found[m.group(2)] = re.sub(r"\s+", " ", re.sub(r"\s*([(),*\[\]])\s*", r"\1", m.group(1))).strip()
    return found


def test_cffi_declarations_are_the_headers():
    """native/build.py's cdef states each function exactly as native/s3d8.h declares it (or, for the wrappers it
    compiles itself, as its own C source defines them): a hand copy that cannot drift."""
    import importlib.util as iu

    root = Path(__file__).resolve().parent.parent / "native"
    spec = iu.spec_from_file_location("native_build", root / "build.py")
    build = iu.module_from_spec(spec)
    spec.loader.exec_module(build)
    cdef = _declarations(build.CDEF)
    header = _declarations((root / "s3d8.h").read_text())
    own = {k: v.removeprefix("static ") for k, v in _declarations((root / "build.py").read_text()).items()
           if v.startswith("static ")}
    assert len(cdef) >= 15
    for name, proto in cdef.items():
        assert proto == header.get(name, own.get(name)), name
    structs = {name: body for name, body in _structs(build.CDEF).items() if "..." not in body}
    assert {"s3d8_weight", "s3d8_layer", "s3d8_decoder"} <= set(structs)
    header_structs = _structs((root / "s3d8.h").read_text())
    for name, body in structs.items():
        assert body == header_structs.get(name), name


def _structs(text: str) -> dict[str, str]:
    """``{name: body with whitespace normalised}`` of the ``typedef struct name { ... } name;`` in ``text``."""
    import re

    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return {m.group(1): re.sub(r"\s+", " ", m.group(2)).strip()
            for m in re.finditer(r"typedef struct (\w+) \{(.*?)\} \1;", text, flags=re.S)}


def spoiled(t: torch.Tensor, how: str) -> torch.Tensor:
    """A copy of ``t`` whose bytes are not all there: storage freed as FSDP2 frees a resharded parameter's,
    shrunk by one element under the tensor, or on the meta device."""
    if how == "meta":
        return t.to("meta")
    c = t.clone()
    c.untyped_storage().resize_(0 if how == "freed" else c.untyped_storage().nbytes() - c.element_size())
    return c


SPOILED = ["freed", "shrunk", "meta"]


def entry_points():
    """``(call, tensors)`` per native entry point: ``call(**tensors)`` runs it, and each tensor's key is the name
    its error must carry."""
    shape = (7, 33)
    w, packed, scale, table = random_s3d8(*shape)
    x, w8, wb = torch.randn(2, 33), s3d8.decode_int8(packed, table, shape), w.to(torch.bfloat16)
    bias, buf = torch.randn(7), torch.zeros(64, dtype=torch.uint8)
    out = torch.empty(7, 33, dtype=torch.int8)
    calls = [(lambda x: native.quantize_activations(x), {"x": x}),
             (lambda packed, table, out: native.s3d8_decode_int8(packed, table, shape, out=out),
              {"packed": packed, "table": table, "out": out}),
             (lambda weight, table: native.s3d8_encode(weight, table), {"weight": w, "table": table}),
             (lambda weight: native.s3d8_encode(weight, table), {"weight": wb}),
             (lambda weight, scale: native.s3d8_encode(weight, table, scale=scale), {"weight": w, "scale": scale}),
             (lambda buf: native.read_bandwidth_probe(buf), {"buf": buf}),
             (lambda x, weight: native.bf16_matmul(x, weight), {"x": x, "weight": wb}),
             (lambda packed, scale, table, bias: native.S3D8Linear(packed, scale, table, shape, bias),
              {"packed": packed, "scale": scale, "table": table, "bias": bias}),
             (lambda weight, scale: native.Int8Linear(weight, scale), {"weight": w8, "scale": scale}),
             (lambda weight: native.Bf16Linear(weight), {"weight": wb})]
    for m in (2, native.FUSED_MAX_M + 3):
        xm = torch.randn(m, 33)
        for path in native.PATHS:
            calls.append((lambda x, packed, scale, table, path=path: native.s3d8_matmul(x, packed, scale, table, shape,
                                                                                         path=path),
                          {"x": xm, "packed": packed, "scale": scale, "table": table}))
        for path in ("fused", "torch"):
            calls.append((lambda x, weight, scale, path=path: native.int8_matmul(x, weight, scale, path=path),
                          {"x": xm, "weight": w8, "scale": scale}))
    return calls


@pytest.mark.parametrize("how", SPOILED)
def test_tensors_without_their_bytes_are_refused_by_every_entry_point(how):
    """A tensor whose storage is gone (a parameter FSDP2 has resharded), shrunk under it, or on the meta device:
    every entry point raises a ValueError naming the argument, in this process (a read would be a segfault)."""
    for call, tensors in entry_points():
        call(**tensors)                                      # whole, it runs
        for name, t in tensors.items():
            with pytest.raises(ValueError, match=f"^{name}: .*(meta device|storage holds)"):
                call(**{**tensors, name: spoiled(t, how)})


def test_a_view_past_its_shrunk_storage_is_refused():
    _, packed, scale, table = random_s3d8(7, 33)
    base = torch.randn(4, 40)
    x = base[1:3, 5:38]                                      # strided: reaches element 2 * 40 + 37 = 117
    base.untyped_storage().resize_(117 * 4)
    with pytest.raises(ValueError, match=r"^x: its storage holds 468 bytes but the tensor \[2, 33\] reaches 472"):
        native.s3d8_matmul(x, packed, scale, table, (7, 33))


@pytest.mark.parametrize("how", SPOILED[:2])
@pytest.mark.parametrize("kind", ["s3d8", "int8", "bf16"])
def test_modules_refuse_buffers_freed_after_construction(kind, how):
    """The modules' hot path skips the argument checks, not this one: a buffer freed after construction (and an
    input without its bytes) is a ValueError naming the module's buffer, for one token and for many."""
    shape = (7, 33)
    w, packed, scale, table = random_s3d8(*shape)
    layer = {"s3d8": lambda: native.S3D8Linear(packed.clone(), scale.clone(), table.clone(), shape, torch.randn(7)),
             "int8": lambda: native.Int8Linear(s3d8.decode_int8(packed, table, shape), scale.clone(), torch.randn(7)),
             "bf16": lambda: native.Bf16Linear(w.to(torch.bfloat16))}[kind]
    for m in (1, native.FUSED_MAX_M + 3):
        with pytest.raises(ValueError, match="^x: .*storage holds"):
            layer()(spoiled(torch.randn(m, 33), how))
        for name in layer()._buffers:
            module = layer()
            module._buffers[name].untyped_storage().resize_(
                0 if how == "freed" else module._buffers[name].untyped_storage().nbytes() - 1)
            with pytest.raises(ValueError, match=f"^{type(module).__name__} buffer '{name}': its storage holds"):
                module(torch.randn(m, 33))
