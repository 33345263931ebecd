"""The native kernel library against the Python reference, bit for bit, for every variant."""

from __future__ import annotations

import importlib.util
import os
import subprocess
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
    with pytest.raises(ValueError, match="contiguous"):
        native.s3d8_matmul(torch.randn(33, 2).T, packed, scale, table, shape)
    with pytest.raises(ValueError, match="contiguous"):
        native.s3d8_decode_int8(torch.zeros(48, 3, dtype=torch.uint8).T, table, shape)
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
