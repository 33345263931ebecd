"""``int8``: per-output-channel INT8, the speed baseline and the precision plan's format for the tensors that
S3D8's bits would break (a token embedding, an output head, an outlier projection).

Packed as two tensors per weight ``P.weight``: ``P.weight.int8`` (int8 ``[d_out, d_in]``, row-major, the values in
[-127, 127]) and ``P.weight.scale`` (bf16 ``[d_out, 1]``); the weight is ``int8 x scale`` in float32. The native
INT8 kernels (``pipeline.native.Int8Linear``) and the C decode step run these bytes as they are."""

from __future__ import annotations

import torch

from pipeline.formats.base import FormatBase, PackedSpecs, State, check_shape, check_weight
from pipeline.quant import INT8_MAX, channel_scale, int8_activations, straight_through

LAYOUT = "s3d8-pipeline-int8-rows-v1"


class INT8(FormatBase):
    """Per-output-channel INT8 with a bf16 absmax/127 scale: the same rounding as the activations
    (``pipeline.quant.int8_activations`` applied to the rows of the weight)."""

    name = "int8"
    label = "INT8"
    native_kernel = True
    layout = LAYOUT
    suffixes = ("int8", "scale")

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

    # --- packed tensors ----------------------------------------------------------------------------------

    def packed_specs(self, shape, state: State) -> PackedSpecs:
        d_out, d_in = check_shape(shape)
        return {"int8": (torch.int8, (d_out, d_in)), "scale": (torch.bfloat16, (d_out, 1))}

    def pack(self, weight: torch.Tensor, state: State) -> dict[str, torch.Tensor]:
        check_weight(weight)
        return self.pack_at_scale(weight, state, self.absmax_scale(weight))

    def unpack(self, tensors: dict[str, torch.Tensor], shape) -> torch.Tensor:
        d_out, d_in = check_shape(shape)
        q, scale = tensors["int8"], tensors["scale"]
        if q.dtype != torch.int8 or tuple(q.shape) != (d_out, d_in):
            raise ValueError(f"int8: expected int8 [{d_out}, {d_in}], got {q.dtype} {list(q.shape)}")
        if scale.numel() != d_out:
            raise ValueError(f"scale: expected {d_out} row scales, got shape {list(scale.shape)}")
        if bool((q == -128).any()):
            raise ValueError("int8: holds -128, outside the format's [-127, 127]")
        return q.float() * scale.reshape(d_out, 1).float()

    def row_block(self, tensors, shape, r0: int, r1: int):
        _, d_in = check_shape(shape)
        return {"int8": tensors["int8"][r0:r1], "scale": tensors["scale"].reshape(-1, 1)[r0:r1]}, (r1 - r0, d_in)

    def native_linear(self, tensors: dict[str, torch.Tensor], shape, bias: torch.Tensor | None):
        """The packed bytes on the native INT8 kernels (INT8 activations per token)."""
        from pipeline import native

        return native.Int8Linear(tensors["int8"].reshape(check_shape(shape)), tensors["scale"].reshape(-1, 1), bias)

    def row_embedding(self, tensors: dict[str, torch.Tensor], shape, padding_idx: int | None = None,
                      dtype: torch.dtype = torch.float32):
        from pipeline import native

        return native.Int8RowEmbedding(tensors["int8"].reshape(check_shape(shape)), tensors["scale"], dtype)

    # --- the scale rule, for a QAT start and learned scales ------------------------------------------------

    def absmax_scale(self, weight: torch.Tensor) -> torch.Tensor:
        return channel_scale(weight)

    def expand_scale(self, scale: torch.Tensor, shape) -> torch.Tensor:
        d_out, d_in = check_shape(shape)
        return scale.reshape(d_out, 1).expand(d_out, d_in)

    def state_of(self, tensors: dict[str, torch.Tensor]) -> State:
        return {}

    def values_at_scale(self, weight: torch.Tensor, state: State, scale: torch.Tensor) -> torch.Tensor:
        w = weight.detach().float()
        return torch.round(w / self.expand_scale(scale.float(), w.shape)).clamp_(-INT8_MAX, INT8_MAX)

    def pack_at_scale(self, weight: torch.Tensor, state: State, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        check_weight(weight)
        scale = scale.reshape(-1, 1).to(torch.bfloat16)
        return {"int8": self.values_at_scale(weight, state, scale).to(torch.int8), "scale": scale}
