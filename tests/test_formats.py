"""All formats: the shared interface, rate-distortion ordering, sizes, bad input."""

import math

import pytest
import torch

from pipeline import formats
from pipeline.formats import scalar

ALL = formats.names()


def test_registry_names_and_unknown():
    assert set(ALL) == {"s3d8", "int", "student_t", "lloyd_max", "int8", "bf16"}
    with pytest.raises(ValueError, match="unknown format 'int4'.*s3d8"):
        formats.get("int4")


@pytest.mark.parametrize("name", ALL)
def test_interface_shape_dtype_gradient_determinism(name):
    fmt = formats.get(name)
    torch.manual_seed(0)
    weight = (torch.randn(10, 200) * 0.05).requires_grad_()
    state = fmt.fit(weight.detach(), seed=1)
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    again = fmt.fit(weight.detach(), seed=1)
    assert state.keys() == again.keys() and all(torch.equal(state[k], again[k]) for k in state)
    q = fmt.quantize(weight, state)
    assert q.shape == weight.shape and q.dtype == weight.dtype
    q.sum().backward()
    assert torch.equal(weight.grad, torch.ones_like(weight))
    assert torch.equal(q, fmt.quantize(weight.detach(), state))
    assert fmt.quantize(weight.detach().bfloat16(), state).dtype == torch.bfloat16


@pytest.mark.parametrize("name", ALL)
def test_bad_weights_are_refused(name):
    fmt = formats.get(name)
    for bad, message in [(torch.tensor([[0.0, float("nan")]]), "NaN or Inf"),
                         (torch.tensor([[float("-inf"), 1.0]]), "NaN or Inf"),
                         (torch.randn(4), "2-D"),
                         (torch.ones(2, 2, dtype=torch.int64), "floating-point")]:
        with pytest.raises(ValueError, match=message):
            fmt.fit(bad)
        with pytest.raises(ValueError, match=message):
            fmt.quantize(bad, fmt.fit(torch.randn(4, 4)) if name != "s3d8" else
                         {"table": torch.zeros(32, 3, dtype=torch.int8)})


def test_bits_per_param_as_the_paper_counts():
    shape = (4096, 4096)
    assert formats.get("s3d8").bits_per_param(shape) == pytest.approx(2.6706, abs=1e-4)
    assert formats.get("int").bits_per_param(shape) == pytest.approx(2.71, abs=0.001)
    assert formats.get("student_t").bits_per_param(shape) == pytest.approx(2.71, abs=0.001)
    assert formats.get("lloyd_max").bits_per_param(shape) == pytest.approx(2.59, abs=0.0015)
    assert formats.get("int8").bits_per_param(shape) == pytest.approx(8.0039, abs=1e-4)
    assert formats.get("bf16").bits_per_param(shape) == 16


def test_storage_bytes_count_padding_and_tables():
    # 5 x 20: S3D8 packs 2 x 32 bytes, 5 bf16 scales, a 96-byte table.
    assert formats.get("s3d8").storage_bytes((5, 20)) == 64 + 10 + 96
    # 6-level codes 3 to a byte: ceil(100 / 3) = 34 bytes; one 128-block per row.
    assert formats.get("int").storage_bytes((5, 20)) == 34 + 10
    assert formats.get("student_t").storage_bytes((5, 20)) == 34 + 10 + 24
    assert formats.get("lloyd_max").storage_bytes((5, 20)) == 34 + 10 + 24
    assert formats.get("int8").storage_bytes((5, 20)) == 100 + 10
    assert formats.get("bf16").storage_bytes((5, 20)) == 200


def test_int_levels_and_block_scale():
    fmt = formats.get("int")
    w = torch.zeros(1, 256)
    w[0, :6] = torch.tensor([-3.0, -2.0, -1.0, 0.0, 1.0, 2.0])
    w[0, 128:131] = torch.tensor([30.0, -7.5, 1.0])     # second block: absmax 30 -> scale 10
    q = fmt.quantize(w, fmt.fit(w))
    assert q[0, :6].tolist() == [-3.0, -2.0, -1.0, 0.0, 1.0, 2.0]
    assert q[0, 128:131].tolist() == [20.0, -10.0, 0.0]  # 3 clips to 2; -0.75 -> -1; 0.1 -> 0


def test_int8_weight_rounding_is_the_activation_rounding():
    from pipeline.quant import int8_activations
    w = torch.randn(8, 64)
    values, scale = int8_activations(w)
    assert torch.equal(formats.get("int8").quantize(w, {}), values.float() * scale.float())


def test_student_t_fit_recovers_heavier_tails():
    fmt = formats.get("student_t")
    torch.manual_seed(0)
    heavy = torch.distributions.StudentT(3.0).sample((64, 1024))
    light = torch.randn(64, 1024)
    assert float(fmt.fit(heavy)["dof"]) < float(fmt.fit(light)["dof"])


def test_codepoints_are_validated():
    with pytest.raises(ValueError, match="strictly increasing"):
        scalar.quantize_scalar(torch.randn(2, 8), torch.tensor([0.0, 0, 1, 2, 3, 4]), None, 1.0)
    with pytest.raises(ValueError, match="6 values"):
        scalar.quantize_scalar(torch.randn(2, 8), torch.arange(5.0), None, 1.0)


def rmse_table(samples: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    table = {}
    for dist, w in samples.items():
        table[dist] = {}
        for name in formats.QUANTISED:
            fmt = formats.get(name)
            q = fmt.quantize(w, fmt.fit(w, seed=0))
            table[dist][name] = float((q - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt())
    return table


def test_rate_distortion_ordering(capsys):
    gen = torch.Generator().manual_seed(0)
    samples = {
        "normal": torch.randn(384, 1024, generator=gen),
        "student-t(5)": torch.distributions.StudentT(5.0).sample((384, 1024)),
    }
    table = rmse_table(samples)
    with capsys.disabled():
        print("\nrelative RMSE  " + "  ".join(f"{n:>9}" for n in formats.QUANTISED))
        for dist, row in table.items():
            print(f"{dist:<14} " + "  ".join(f"{row[n]:9.4f}" for n in formats.QUANTISED))
    for dist, row in table.items():
        assert row["s3d8"] < row["lloyd_max"] < row["int"], (dist, row)
    # The published synthetic figures on Normal data: 1-D 6-point 0.241, S3D8 0.209.
    assert table["normal"]["s3d8"] == pytest.approx(0.209, abs=0.01)
    assert table["normal"]["lloyd_max"] == pytest.approx(0.241, abs=0.01)
    assert all(math.isfinite(v) for row in table.values() for v in row.values())


@pytest.mark.parametrize("name", ["int", "student_t", "lloyd_max"])
def test_scalar_formats_pack_and_unpack_bit_for_bit(name):
    fmt = formats.get(name)
    torch.manual_seed(2)
    for shape in [(1, 1), (3, 130), (7, 257)]:
        weight = torch.randn(shape)
        state = fmt.fit(weight)
        codes, scale = scalar.encode(weight, state["codepoints"], fmt.block, fmt.qmax)
        assert codes.numel() == -(-shape[0] * shape[1] // 3)
        back = scalar.decode(codes, scale, state["codepoints"], fmt.block, shape)
        assert torch.equal(back, fmt.quantize(weight, state))
    with pytest.raises(ValueError, match="needs"):
        scalar.decode(codes[:-1], scale, state["codepoints"], fmt.block, shape)


@pytest.mark.parametrize("name", ["int8", "bf16"])
def test_baselines_store_decode_and_run_native_as_the_runtime_reads_them(name):
    """INT8 and bf16 own their stored tensors as S3D8 does: ``pack`` / ``unpack`` equal ``quantize``, ``stored_names``
    names the file's tensors (bf16: the weight itself), a row block decodes those rows, and the native linear and
    row embedding the runtime builds from the stored tensors compute with the same weights."""
    from pipeline import native

    fmt = formats.get(name)
    w = torch.randn(12, 40)
    t = fmt.pack(w, fmt.fit(w))
    assert {s: (v.dtype, tuple(v.shape)) for s, v in t.items()} == fmt.packed_specs((12, 40), {})
    decoded = fmt.unpack(t, (12, 40))
    assert torch.equal(decoded, fmt.quantize(w, {}).float())
    names = fmt.stored_names("model.layers.0.mlp.up_proj.weight")
    assert list(names) == list(fmt.suffixes)
    assert names == ({"weight": "model.layers.0.mlp.up_proj.weight"} if name == "bf16" else
                     {s: f"model.layers.0.mlp.up_proj.weight.{s}" for s in fmt.suffixes})
    file = {names[s]: v for s, v in t.items()}
    assert all(torch.equal(fmt.stored(file, "model.layers.0.mlp.up_proj.weight")[s], t[s]) for s in t)
    block, shape = fmt.row_block(t, (12, 40), 3, 9)
    assert shape == (6, 40) and torch.equal(fmt.unpack(block, shape), decoded[3:9])
    ids = torch.tensor([[4, 0, 11]])
    assert torch.equal(fmt.row_embedding(t, (12, 40))(ids), decoded[ids])
    x = torch.randn(3, 40)
    expected = (native.int8_matmul(x, t["int8"], t["scale"]) if name == "int8"
                else native.bf16_matmul(x, t["weight"]))
    assert torch.allclose(fmt.native_linear(t, (12, 40), None)(x), expected, rtol=1e-5, atol=1e-5)
    assert fmt.native_kernel
