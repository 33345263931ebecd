"""``int8``: per-output-channel INT8, the speed baseline."""

from __future__ import annotations

import torch

from pipeline.formats.base import FormatBase, State, check_shape, check_weight
from pipeline.quant import int8_activations, straight_through


class INT8(FormatBase):
    """Per-output-channel INT8 with a bf16 absmax/127 scale: the same rounding as the activations
    (``pipeline.quant.int8_activations`` applied to the rows of the weight)."""

    name = "int8"
    label = "INT8"

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
