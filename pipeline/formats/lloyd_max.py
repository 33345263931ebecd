"""``lloyd_max``: 6 code points by 1-D Lloyd-Max on channel-normalised weights (SPEC section 3)."""

from __future__ import annotations

import torch

from pipeline.formats.base import State, check_weight
from pipeline.formats.scalar import Scalar6, subsample, lloyd_max_1d
from pipeline.quant import channel_scale


class LloydMax(Scalar6):
    """6 code points fitted by 1-D Lloyd-Max to the channel-normalised weights, bf16 absmax scale
    per output channel (the whole row is one block)."""

    name = "lloyd_max"
    label = "lloyd-max"
    block = None
    qmax = 1.0
    refit_codepoints = True
    MAX_SAMPLES = 2 ** 22

    def fit(self, weight: torch.Tensor, seed: int = 0) -> State:
        check_weight(weight)
        u = weight.detach().float() / channel_scale(weight, self.qmax).float()
        return {"codepoints": lloyd_max_1d(subsample(u, self.MAX_SAMPLES, seed))}
