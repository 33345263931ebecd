"""The unquantised reference (bf16) and the speed baseline (per-channel INT8)."""

from __future__ import annotations

import torch

from pipeline.formats.base import State, check_shape, check_weight
from pipeline.quant import int8_activations, straight_through


class BF16:
    """bfloat16 weights: the teacher's format (round to nearest even)."""

    name = "bf16"

    def fit(self, weight: torch.Tensor, seed: int = 0) -> State:
        check_weight(weight)
        return {}

    def quantize(self, weight: torch.Tensor, state: State) -> torch.Tensor:
        check_weight(weight)
        return straight_through(weight, weight.detach().to(torch.bfloat16).to(weight.dtype))

    def bits_per_param(self, shape) -> float:
        check_shape(shape)
        return 16.0

    def storage_bytes(self, shape) -> int:
        d_out, d_in = check_shape(shape)
        return 2 * d_out * d_in


class INT8:
    """Per-output-channel INT8 with a bf16 absmax/127 scale: the same rounding as the activations
    (``pipeline.quant.int8_activations`` applied to the rows of the weight)."""

    name = "int8"

    def fit(self, weight: torch.Tensor, seed: int = 0) -> State:
        check_weight(weight)
        return {}

    def quantize(self, weight: torch.Tensor, state: State) -> torch.Tensor:
        check_weight(weight)
        q, scale = int8_activations(weight)
        return straight_through(weight, (q.float() * scale.float()).to(weight.dtype))

    def bits_per_param(self, shape) -> float:
        _, d_in = check_shape(shape)
        return 8 + 16 / d_in

    def storage_bytes(self, shape) -> int:
        d_out, d_in = check_shape(shape)
        return d_out * d_in + 2 * d_out
