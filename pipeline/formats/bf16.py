"""``bf16``: the unquantised reference, the teacher's format."""

from __future__ import annotations

import torch

from pipeline.formats.base import FormatBase, State, check_shape, check_weight
from pipeline.quant import straight_through


class BF16(FormatBase):
    """bfloat16 weights: the teacher's format (round to nearest even)."""

    name = "bf16"
    label = "bf16"

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
