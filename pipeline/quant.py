"""The numerics every other module shares: channel scales, INT8 activations, the straight-through estimator.

SPEC section 2: activations are channel-scaled INT8 per token (per row of the 2-D input), with
``scale = bf16(absmax / 127)`` (absmax 0 -> 1) and ``q = round(x / scale)`` clamped to [-127, 127].
This module holds the only implementation; QAT, the native kernels' tests and evaluation import it.

Non-finite values (the policy the native kernels share bit for bit, ``pipeline.native``): a row
(token) holding any NaN or +-Inf quantises to all zeros with scale NaN, so its products are an
all-NaN output row (and ``fake_quant_activations`` returns NaN for the whole row); in
``int8_matmul_reference`` a NaN or +-Inf weight channel scale gives NaN in that output column.
Finite input is unaffected.
"""

from __future__ import annotations

import torch

INT8_MAX = 127


def channel_scale(x: torch.Tensor, qmax: float = INT8_MAX) -> torch.Tensor:
    """Per-row scale ``bf16(absmax(row) / qmax)`` as a bfloat16 tensor of shape ``[..., 1]``.

    The division is done in float32 and rounded once to bfloat16 (nearest even); a row whose absmax
    is 0 gets scale 1 so that decoding stays finite and exact.
    """
    absmax = x.detach().float().abs().amax(dim=-1, keepdim=True)
    scale = (absmax / qmax).to(torch.bfloat16)
    return torch.where(absmax == 0, torch.ones_like(scale), scale)


def _nan_if_not_finite(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` with every +-Inf (and NaN) replaced by NaN: the non-finite policy's marker."""
    return torch.where(torch.isfinite(scale), scale, torch.full_like(scale, float("nan")))


def _rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``round(x / scale)`` clamped to [-127, 127] (as float values) and the bf16 scales.

    A row with NaN or +-Inf has scale NaN (its absmax is NaN or Inf), so its values are NaN here."""
    if not x.is_floating_point():
        raise ValueError(f"int8_activations: expected a floating-point tensor, got {x.dtype}")
    scale = _nan_if_not_finite(channel_scale(x))
    return torch.round(x.detach().float() / scale.float()).clamp_(-INT8_MAX, INT8_MAX), scale


def int8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` per row to INT8: returns ``(int8 values, bfloat16 scales [..., 1])``.

    ``values * scales`` approximates ``x``; rounding is half to even (``torch.round``), matching
    ``rintf`` in the native kernels. A row with NaN or +-Inf gives zeros and scale NaN; a NaN from
    0 / 0 (a scale that underflowed to 0) gives 0, as in the native kernels.
    """
    q, scale = _rounded(x)
    return torch.nan_to_num_(q, nan=0.0).to(torch.int8), scale


class _StraightThrough(torch.autograd.Function):
    """Forward returns the quantised tensor exactly; backward passes the gradient to the input unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return quantized

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        return grad, None


def straight_through(x: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    """``quantized`` in the forward pass, identity gradient to ``x`` in the backward pass.

    Unlike ``x + (q - x).detach()`` the forward value is bit-identical to ``quantized``.
    """
    if not x.requires_grad:
        return quantized
    return _StraightThrough.apply(x, quantized.detach())


def fake_quant_activations(x: torch.Tensor) -> torch.Tensor:
    """INT8 round trip of activations (per token) with a straight-through gradient, in ``x``'s dtype."""
    q, scale = _rounded(x)        # the values of int8_activations, kept in float: no round trip
    return straight_through(x, (q * scale.float()).to(x.dtype))


def int8_matmul_reference(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
                          w_scale: torch.Tensor) -> torch.Tensor:
    """Reference INT8 product: ``((float)(xq @ wq.T as int32) * x_scale[m]) * w_scale[n]`` in float32.

    The epilogue order is part of the contract the native kernels reproduce bit for bit. A NaN or
    +-Inf scale (token or channel) gives NaN in its output row or column.
    """
    acc = xq.to(torch.int32) @ wq.to(torch.int32).T
    x_scale = _nan_if_not_finite(x_scale.float().reshape(-1, 1))
    w_scale = _nan_if_not_finite(w_scale.float().reshape(1, -1))
    return acc.float() * x_scale * w_scale
