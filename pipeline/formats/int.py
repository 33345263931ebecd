"""``int``: the 6-level integer format of the paper's comparison (SPEC section 3)."""

from __future__ import annotations

import torch

from pipeline.formats.base import State, check_weight
from pipeline.formats.scalar import BLOCK, Scalar6


class Int(Scalar6):
    """6-level integer {-3..2}, bf16 absmax scale per 128-wide block (absmax maps to 3, so the top
    positive level 2 clips the largest positive values: the format is asymmetric by construction)."""

    name = "int"
    label = "INT"
    block = BLOCK
    qmax = 3.0
    table_bytes = 0
    CODEPOINTS = torch.arange(-3, 3, dtype=torch.float32)

    def fit(self, weight: torch.Tensor, seed: int = 0) -> State:
        check_weight(weight)
        return {"codepoints": self.CODEPOINTS.clone()}
