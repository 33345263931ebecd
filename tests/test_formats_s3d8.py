"""S3D8 reference: byte layout, lookup tables, padding, zero handling, determinism, bad input."""

import pytest
import torch

from pipeline.formats import s3d8

# (q, s0, s1, s2) -> byte, worked out by hand from the layout [S2^S0, S1, Q4..Q0, S0].
HAND_BYTES = [
    (0, 0, 0, 0, 0x00), (0, 1, 0, 0, 0x81), (0, 0, 1, 0, 0x40), (0, 0, 0, 1, 0x80),
    (0, 1, 1, 0, 0xC1), (0, 1, 0, 1, 0x01), (0, 0, 1, 1, 0xC0), (0, 1, 1, 1, 0x41),
    (31, 0, 0, 0, 0x3E), (31, 1, 0, 0, 0xBF), (31, 0, 1, 0, 0x7E), (31, 0, 0, 1, 0xBE),
    (31, 1, 1, 0, 0xFF), (31, 1, 0, 1, 0x3F), (31, 0, 1, 1, 0xFE), (31, 1, 1, 1, 0x7F),
]


def hand_table() -> torch.Tensor:
    """Row 0 = (10, 20, 30), row 31 = (127, 127, 127), row 5 = (0, 0, 0), the rest far from both."""
    t = torch.full((32, 3), 64, dtype=torch.int8)
    t[:, 0] = torch.arange(32, dtype=torch.int8) + 40
    t[0] = torch.tensor([10, 20, 30])
    t[5] = torch.tensor([0, 0, 0])
    t[31] = torch.tensor([127, 127, 127])
    return t


def test_byte_layout_every_sign_pattern_index_0_and_31():
    table = hand_table()
    cols = []
    for q, s0, s1, s2, _ in HAND_BYTES:
        mag = table[q].float()
        cols.append(mag * torch.tensor([-1.0 if s else 1.0 for s in (s0, s1, s2)]))
    weight = torch.stack(cols, dim=1)              # [3, 16]; every row's absmax is 127 -> scale 1
    packed, scale = s3d8.encode(weight, table)
    assert packed.shape == (1, 16) and packed.dtype == torch.uint8
    assert scale.dtype == torch.bfloat16 and torch.equal(scale.float(), torch.ones(3, 1))
    assert packed[0].tolist() == [b for *_, b in HAND_BYTES]
    assert torch.equal(s3d8.decode(packed, scale, table, (3, 16)), weight)


def test_signed_luts_permutation():
    table = hand_table()
    luts = s3d8.signed_luts(table)
    assert luts.shape == (3, 64) and luts.dtype == torch.int8
    for q in range(32):
        assert luts[0, 2 * q] == table[q, 0] and luts[0, 2 * q + 1] == -table[q, 0]
        assert luts[1, q] == table[q, 1] and luts[1, q + 32] == -table[q, 1]
        assert luts[2, 2 * q] == table[q, 2] and luts[2, 2 * q + 1] == -table[q, 2]


def test_decode_through_luts_matches_the_sign_rule():
    table = hand_table()
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    w = s3d8.decode_int8(every_byte, table, (48, 16))
    for byte in range(256):
        q, s0, s1, s2 = (byte >> 1) & 31, byte & 1, (byte >> 6) & 1, ((byte >> 7) ^ byte) & 1
        g, k = divmod(byte, 16)
        want = [(-1 if s else 1) * int(table[q, j]) for j, s in enumerate((s0, s1, s2))]
        assert w[3 * g:3 * g + 3, k].tolist() == want


def test_zero_takes_the_positive_sign():
    table = hand_table()
    weight = torch.zeros(3, 16)
    weight[:, 0] = 127.0                          # fixes the scale at 1
    weight[:, 1] = -0.0
    packed, _ = s3d8.encode(weight, table)
    assert packed[0, 1] == 5 << 1 and packed[0, 2] == 5 << 1   # nearest to (0,0,0) is row 5, signs +


def test_padding_when_shape_is_not_aligned():
    torch.manual_seed(1)
    weight = torch.randn(5, 20)
    table = s3d8.fit_centroids(weight)
    packed, scale = s3d8.encode(weight, table)
    assert packed.shape == (2, 32) and scale.shape == (5, 1)
    zero_code = int(s3d8.nearest_centroid(torch.zeros(1, 3), table)) << 1
    assert (packed[:, 20:] == zero_code).all(), "padded columns encode the zero vector"
    full = s3d8.decode_int8(packed, table, (6, 32))
    partial = s3d8.decode(packed, scale, table, (5, 20))
    assert partial.shape == (5, 20)
    assert torch.equal(partial, full[:5, :20].float() * scale.float())
    assert torch.equal(partial, s3d8.quantize(weight, table))


def test_all_zero_rows_get_the_smallest_scale_and_decode_to_about_zero():
    """SPEC section 1 (corrected): scale = bf16(max(absmax / 127, 2^-126)), the reference packer's rule."""
    table = hand_table()
    weight = torch.randn(9, 16)
    weight[1] = 0.0                               # a zero row in a group with non-zero rows
    weight[3:6] = 0.0                             # a whole group of zero rows
    packed, scale = s3d8.encode(weight, table)
    assert scale[1].item() == 2.0 ** -126 and (scale[3:6] == 2.0 ** -126).all()
    decoded = s3d8.decode(packed, scale, table, weight.shape)
    assert torch.isfinite(decoded).all()
    assert decoded[1].abs().max() <= 127 * 2.0 ** -126                # whatever its group's centroid: ~0
    assert (decoded[3:6] == 0).all()              # the centroid nearest zero is (0, 0, 0) here
    assert (packed[1] == 5 << 1).all()
    tiny = torch.full((3, 16), 1e-40)             # absmax / 127 below the smallest normal: not 0, 2^-126
    assert (s3d8.weight_scale(tiny) == 2.0 ** -126).all()


def test_ties_go_to_the_first_centroid():
    table = hand_table()
    table[7] = table[0]
    assert s3d8.nearest_centroid(torch.tensor([[10.0, 20.0, 30.0]]), table).item() == 0


def test_quantize_equals_decode_of_encode_bit_for_bit():
    torch.manual_seed(0)
    for shape in [(1, 1), (3, 16), (7, 33), (64, 100), (100, 70)]:
        weight = torch.randn(shape) * 0.02
        table = s3d8.fit_centroids(weight, seed=3)
        q = s3d8.quantize(weight, table)
        assert q.dtype == weight.dtype and q.shape == weight.shape
        assert torch.equal(q, s3d8.decode(*s3d8.encode(weight, table), table, shape))


def test_quantize_native_and_reference_paths_agree():
    torch.manual_seed(4)
    for shape in [(5, 20), (96, 257)]:
        weight = torch.randn(shape)
        table = s3d8.fit_centroids(weight)
        assert torch.equal(s3d8.quantize(weight, table, use_native=False), s3d8.quantize(weight, table))


@pytest.mark.parametrize("sizes", [(5, 48), s3d8._ACCELERATOR_WORK_SIZES])
def test_work_sizes_do_not_change_a_bit(monkeypatch, sizes):
    """The accelerator's large steps (and tiny ones that split rows and steps unevenly) give the CPU's bits:
    the step size bounds memory, never the arithmetic."""
    torch.manual_seed(5)
    weight = torch.randn(100, 70) * torch.rand(100, 1)
    table = s3d8.fit_centroids(weight, seed=1)
    expected = s3d8.quantize(weight, table, use_native=False)
    packed = s3d8.encode(weight, table)
    monkeypatch.setattr(s3d8, "_WORK_SIZES", {"cpu": sizes})
    assert torch.equal(s3d8.quantize(weight, table, use_native=False), expected)
    assert all(torch.equal(a, b) for a, b in zip(s3d8.encode(weight, table), packed))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")
def test_quantize_on_cuda_equals_the_cpu_bit_for_bit():
    torch.manual_seed(6)
    weight = torch.randn(300, 257)
    table = s3d8.fit_centroids(weight)
    expected = s3d8.quantize(weight, table, use_native=False)
    got = s3d8.quantize(weight.cuda(), table)
    assert got.device.type == "cuda" and torch.equal(got.cpu(), expected)


def test_quantize_keeps_dtype_and_passes_gradient_straight_through():
    weight = torch.randn(9, 32, dtype=torch.bfloat16, requires_grad=True)
    table = s3d8.fit_centroids(weight.detach())
    q = s3d8.quantize(weight, table)
    assert q.dtype == torch.bfloat16
    q.float().mul(torch.arange(32.0)).sum().backward()
    assert torch.equal(weight.grad.float(), torch.arange(32.0).expand(9, 32))


def test_fit_is_deterministic_and_in_range():
    weight = torch.randn(96, 256)
    a = s3d8.fit_centroids(weight, seed=7)
    b = s3d8.fit_centroids(weight, seed=7)
    assert torch.equal(a, b) and a.dtype == torch.int8 and a.shape == (32, 3)
    assert int(a.min()) >= 0 and int(a.max()) <= 127
    assert torch.equal(s3d8.encode(weight, a)[0], s3d8.encode(weight, b)[0])
    small = s3d8.fit_centroids(weight, seed=7, max_vectors=1000)
    assert small.shape == (32, 3)


@pytest.mark.parametrize("weight, message", [
    (torch.tensor([[1.0, float("nan")]]), "NaN or Inf"),
    (torch.tensor([[1.0, float("inf")]]), "NaN or Inf"),
    (torch.randn(2, 3, 4), "2-D"),
    (torch.ones(3, 16, dtype=torch.int32), "floating-point"),
])
def test_bad_weights_are_refused(weight, message):
    with pytest.raises(ValueError, match=message):
        s3d8.encode(weight, hand_table())
    with pytest.raises(ValueError, match=message):
        s3d8.fit_centroids(weight)


@pytest.mark.parametrize("table, message", [
    (torch.zeros(31, 3, dtype=torch.int8), r"shape \[32, 3\]"),
    (torch.zeros(32, 3), "integer dtype"),
    (torch.full((32, 3), -1, dtype=torch.int8), r"\[0, 127\]"),
    (torch.full((32, 3), 200, dtype=torch.int16), r"\[0, 127\]"),
])
def test_bad_tables_are_refused(table, message):
    with pytest.raises(ValueError, match=message):
        s3d8.encode(torch.randn(3, 16), table)


def test_packed_of_the_wrong_length_is_refused():
    table = hand_table()
    packed, scale = s3d8.encode(torch.randn(5, 20), table)
    with pytest.raises(ValueError, match="needs 2 x 32 = 64 bytes"):
        s3d8.decode(packed.reshape(-1)[:-1], scale, table, (5, 20))
    with pytest.raises(ValueError, match="uint8"):
        s3d8.decode(packed.to(torch.int16), scale, table, (5, 20))
    assert torch.equal(s3d8.decode(packed.reshape(-1), scale, table, (5, 20)),
                       s3d8.decode(packed, scale, table, (5, 20)))
