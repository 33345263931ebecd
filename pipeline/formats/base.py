"""The interface every weight format offers, and the input checks they share."""

from __future__ import annotations

import math
from typing import Protocol

import torch

State = dict[str, torch.Tensor]
"""A format's fitted state (centroid table, code points): named tensors, stored as safetensors."""


class Format(Protocol):
    name: str

    def fit(self, weight: torch.Tensor, seed: int = 0) -> State:
        """Fit the format's state (deterministic for a seed) to one weight matrix."""

    def quantize(self, weight: torch.Tensor, state: State) -> torch.Tensor:
        """Fake-quantised weight: same shape and dtype, straight-through gradient."""

    def bits_per_param(self, shape: tuple[int, int]) -> float:
        """Nominal bits per parameter, counted as the paper does (no padding, no tables)."""

    def storage_bytes(self, shape: tuple[int, int]) -> int:
        """Bytes the packed tensors really take: codes, scales, tables and padding."""


def check_weight(weight: torch.Tensor, what: str = "weight") -> None:
    """Reject what no format can quantise: wrong rank, integer dtype, NaN or Inf."""
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"{what}: expected a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"{what}: expected a 2-D tensor [d_out, d_in], got rank {weight.dim()} "
                         f"(shape {tuple(weight.shape)})")
    if not weight.is_floating_point():
        raise ValueError(f"{what}: expected a floating-point dtype, got {weight.dtype}")
    w = weight.detach()
    # amax/amin propagate NaN and keep Inf: two reductions instead of a full boolean copy.
    if w.numel() and not (torch.isfinite(w.amax()) and torch.isfinite(w.amin())):
        bad = (~torch.isfinite(w)).nonzero()[0].tolist()
        raise ValueError(f"{what}: contains NaN or Inf (first at index {bad})")


def check_shape(shape) -> tuple[int, int]:
    if len(shape) != 2 or any(int(s) < 1 for s in shape):
        raise ValueError(f"shape: expected (d_out, d_in) with positive sizes, got {tuple(shape)}")
    return int(shape[0]), int(shape[1])


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return ceil_div(a, b) * b


LOG2_6 = math.log2(6)
