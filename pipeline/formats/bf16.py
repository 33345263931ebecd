"""``bf16``: the unquantised reference, the teacher's format, and the speed baseline's.

Stored as it is: one bfloat16 tensor under the weight's own name ``P.weight`` (a plain safetensors weight; not a
packed layout of its own, so never a packed file's ``format``: the precision plan's ``bf16`` rule keeps a weight this
way inside a packed file). The native bf16 kernels (``pipeline.native.Bf16Linear``) run these bytes as they are."""

from __future__ import annotations

import torch

from pipeline.formats.base import FormatBase, PackedSpecs, State, check_shape, check_weight
from pipeline.quant import straight_through


class BF16(FormatBase):
    """bfloat16 weights: the teacher's format (round to nearest even)."""

    name = "bf16"
    label = "bf16"
    native_kernel = True
    suffixes = ("weight",)

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

    # --- the stored tensor -------------------------------------------------------------------------------

    def stored_names(self, name: str) -> dict[str, str]:
        return {"weight": name}

    def packed_specs(self, shape, state: State) -> PackedSpecs:
        return {"weight": (torch.bfloat16, check_shape(shape))}

    def pack(self, weight: torch.Tensor, state: State) -> dict[str, torch.Tensor]:
        check_weight(weight)
        return {"weight": weight.detach().to(torch.bfloat16)}

    def unpack(self, tensors: dict[str, torch.Tensor], shape) -> torch.Tensor:
        shape = check_shape(shape)
        w = tensors["weight"]
        if w.dtype != torch.bfloat16 or w.numel() != shape[0] * shape[1]:
            raise ValueError(f"weight: expected bfloat16 {list(shape)}, got {w.dtype} {list(w.shape)}")
        return w.reshape(shape).float()

    def row_block(self, tensors, shape, r0: int, r1: int):
        _, d_in = check_shape(shape)
        return {"weight": tensors["weight"].reshape(-1, d_in)[r0:r1]}, (r1 - r0, d_in)

    def native_linear(self, tensors: dict[str, torch.Tensor], shape, bias: torch.Tensor | None):
        """The bf16 bytes on the native bf16 kernels (float32 arithmetic)."""
        from pipeline import native

        if bias is not None:
            raise ValueError("bf16: the native bf16 linear has no bias")
        return native.Bf16Linear(tensors["weight"].reshape(check_shape(shape)))

    def row_embedding(self, tensors: dict[str, torch.Tensor], shape, padding_idx: int | None = None,
                      dtype: torch.dtype = torch.float32):
        from pipeline import native

        return native.Bf16RowEmbedding(tensors["weight"].reshape(check_shape(shape)), dtype)
