"""The one activation quantiser (SPEC section 2) and the straight-through estimator."""

import pytest
import torch

from pipeline.quant import channel_scale, fake_quant_activations, int8_activations, int8_matmul_reference


def test_int8_activations_hand_example():
    x = torch.tensor([[127.0, -63.5, 0.5, 1.5, -2.5], [0.0, 0.0, 0.0, 0.0, 0.0]])
    q, scale = int8_activations(x)
    assert scale.dtype == torch.bfloat16 and scale.shape == (2, 1)
    assert scale.float().tolist() == [[1.0], [1.0]]
    # Rounding is half to even: -63.5 -> -64, 0.5 -> 0, 1.5 -> 2, -2.5 -> -2.
    assert q.tolist() == [[127, -64, 0, 2, -2], [0, 0, 0, 0, 0]]


def test_scale_is_bf16_of_absmax_over_127():
    x = torch.tensor([[3.0, -1.0], [-1000.0, 7.0]])
    scale = channel_scale(x)
    assert torch.equal(scale, (torch.tensor([[3.0], [1000.0]]) / 127).to(torch.bfloat16))
    q, _ = int8_activations(x)
    assert q.abs().max() <= 127 and q.dtype == torch.int8


def test_values_clamp_to_127_when_bf16_rounds_the_scale_down():
    x = torch.tensor([[128.0, 1.0]])          # 128/127 rounds down in bf16 -> 128/scale > 127
    q, scale = int8_activations(x)
    assert float(scale) < 128 / 127 and q[0, 0] == 127


def test_rows_are_tokens_for_any_leading_shape():
    x = torch.randn(2, 3, 8)
    q, scale = int8_activations(x)
    assert q.shape == (2, 3, 8) and scale.shape == (2, 3, 1)
    q2, s2 = int8_activations(x.reshape(6, 8))
    assert torch.equal(q.reshape(6, 8), q2) and torch.equal(scale.reshape(6, 1), s2)


def test_fake_quant_activations_straight_through():
    x = torch.randn(4, 16, requires_grad=True)
    y = fake_quant_activations(x)
    q, scale = int8_activations(x)
    assert torch.equal(y, q.float() * scale.float())
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_integer_input_is_refused():
    with pytest.raises(ValueError, match="floating-point"):
        int8_activations(torch.ones(2, 2, dtype=torch.int32))


def test_int8_matmul_reference_epilogue_order():
    xq = torch.tensor([[1, 2]], dtype=torch.int8)
    wq = torch.tensor([[3, 4], [-5, 6]], dtype=torch.int8)
    xs = torch.tensor([[0.5]], dtype=torch.bfloat16)
    ws = torch.tensor([[2.0], [0.25]], dtype=torch.bfloat16)
    assert int8_matmul_reference(xq, xs, wq, ws).tolist() == [[11.0, 0.875]]


def test_nonfinite_token_quantises_to_zeros_with_nan_scale():
    """Issue 12 policy: a row with NaN or +-Inf -> zeros and scale NaN (the products are NaN rows);
    the other rows are exactly as before."""
    x = torch.tensor([[1.0, float("nan"), 3.0], [float("inf"), 1.0, 2.0], [-float("inf"), 0.0, 0.0],
                      [127.0, -63.5, 0.5]])
    q, scale = int8_activations(x)
    assert q[:3].eq(0).all() and torch.isnan(scale[:3]).all()
    assert scale[:3].view(torch.int16).eq(0x7FC0).all()          # the canonical NaN, as in C
    assert q[3].tolist() == [127, -64, 0] and scale[3].item() == 1.0
    y = fake_quant_activations(x)
    assert torch.isnan(y[:3]).all() and torch.equal(y[3], q[3].float() * scale[3].float())


def test_int8_matmul_reference_nonfinite_scales():
    xq = torch.tensor([[1, 2], [3, 4]], dtype=torch.int8)
    wq = torch.tensor([[3, 4], [-5, 6], [0, 0]], dtype=torch.int8)
    xs = torch.tensor([[0.5], [float("nan")]], dtype=torch.bfloat16)
    ws = torch.tensor([[2.0], [float("inf")], [-float("inf")]], dtype=torch.bfloat16)
    y = int8_matmul_reference(xq, xs, wq, ws)
    assert y[0, 0] == 11.0
    assert torch.isnan(y[1]).all() and torch.isnan(y[:, 1:]).all()   # Inf scale -> NaN, 0 * Inf too
    assert y.view(torch.int32)[torch.isnan(y)].eq(0x7FC00000).all()


def test_scale_underflow_still_gives_zero():
    """A finite row whose scale rounds to 0 in bf16: 0 / 0 gives 0 (unchanged by the policy)."""
    x = torch.tensor([[1e-40, 0.0, -1e-40]])
    q, scale = int8_activations(x)
    assert scale.item() == 0.0 and q.tolist() == [[127, 0, -127]]
