"""The modules a packed weight becomes at load (``pipeline.packed.file.load_packed_model``, the Hugging Face
quantizer): decoded once (``eager``), decoded in each forward from the packed bytes (``lazy``), or the native
kernels on the packed bytes; :func:`packed_layer` chooses and validates."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.formats import FormatBase
from pipeline.quant import fake_quant_activations
from pipeline.recipe import Quantised


class PackedLinear(Quantised):
    """A linear layer with its weight decoded once from the packed file; INT8 activations per token.

    The forward equals the QAT forward (``QuantLinear``) bit for bit: same decoded weight, same
    activation quantiser, same ``F.linear``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act_quant: bool) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.act_quant = act_quant
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_quant:
            x = fake_quant_activations(x)
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


class PackedEmbedding(Quantised):
    def __init__(self, weight: torch.Tensor, padding_idx: int | None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight, self.padding_idx)


_ROW_BLOCK_ELEMS = 1 << 20      # weights decoded at a time when validating or gathering embedding rows
_LINEAR_BLOCK_ELEMS = 1 << 26   # a lazy Linear above this many weights is decoded in blocks of rows (256 MB fp32)


def _block_rows(shape: tuple[int, int]) -> int:
    return max(3, _ROW_BLOCK_ELEMS // max(shape[1], 1) // 3 * 3)


def _validate_blockwise(fmt: FormatBase, tensors: dict[str, torch.Tensor], shape: tuple[int, int]) -> None:
    """Decode the weight block by block and drop it: the format's own checks run on every byte,
    with memory bounded by one block."""
    rows = _block_rows(shape)
    if fmt.row_block(tensors, shape, 0, min(rows, shape[0])) is None:
        fmt.unpack(tensors, shape)
        return
    for r0 in range(0, shape[0], rows):
        part, part_shape = fmt.row_block(tensors, shape, r0, min(r0 + rows, shape[0]))
        fmt.unpack(part, part_shape)


class _LazyPacked(Quantised):
    """Holds a weight's packed tensors (buffers ``weight_<suffix>``) and decodes on demand, with the
    format's own ``unpack``: the numbers equal the eagerly decoded weight's bit for bit."""

    def _setup(self, fmt: FormatBase, tensors: dict[str, torch.Tensor], shape: tuple[int, int],
               dtype: torch.dtype) -> None:
        self.format = fmt
        self.shape = tuple(shape)
        self.weight_dtype = dtype
        for suffix in fmt.suffixes:
            self.register_buffer(f"weight_{suffix}", tensors[suffix])

    @property
    def packed_tensors(self) -> dict[str, torch.Tensor]:
        return {s: getattr(self, f"weight_{s}") for s in self.format.suffixes}

    @property
    def weight(self) -> torch.Tensor:
        """The whole decoded weight (built on every access: the module keeps only the packed bytes)."""
        return self.format.unpack(self.packed_tensors, self.shape).to(self.weight_dtype)

    def extra_repr(self) -> str:
        return f"format={self.format.name}, shape={list(self.shape)}, decode=lazy"


class LazyPackedLinear(_LazyPacked):
    """:class:`PackedLinear` that keeps the packed tensors and decodes the weight in each forward."""

    def __init__(self, fmt: FormatBase, tensors: dict[str, torch.Tensor], shape: tuple[int, int],
                 bias: torch.Tensor | None, act_quant: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self._setup(fmt, tensors, shape, dtype)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.act_quant = act_quant
        self.out_features, self.in_features = self.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_quant:
            x = fake_quant_activations(x)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        d_out, d_in = self.shape
        rows = max(3, _LINEAR_BLOCK_ELEMS // d_in // 3 * 3)
        tensors = self.packed_tensors
        if d_out <= rows or self.format.row_block(tensors, self.shape, 0, rows) is None:
            return F.linear(x, self.weight.to(x.dtype), bias)
        # A big weight (the 11B's lm_head: 128,256 x 4,096, 2.1 GB in fp32) is decoded a block of output rows
        # at a time, each block's outputs written in place: the temporaries stay one block whatever its size.
        # Each output is the same dot product; only a BLAS that picks another kernel for the block's shape
        # can change the last bits (tested to 1e-5; toy-sized weights never take this path).
        out = torch.empty(*x.shape[:-1], d_out, dtype=x.dtype, device=x.device)
        for r0 in range(0, d_out, rows):
            r1 = min(r0 + rows, d_out)
            part, part_shape = self.format.row_block(tensors, self.shape, r0, r1)
            w = self.format.unpack(part, part_shape).to(x.dtype)
            out[..., r0:r1] = F.linear(x, w, None if bias is None else bias[r0:r1])
        return out


class LazyPackedEmbedding(_LazyPacked):
    """:class:`PackedEmbedding` that keeps the packed tensors and decodes only the rows a forward looks
    up (in blocks of rows), so a 128k-token table is never decoded whole."""

    def __init__(self, fmt: FormatBase, tensors: dict[str, torch.Tensor], shape: tuple[int, int],
                 padding_idx: int | None, dtype: torch.dtype) -> None:
        super().__init__()
        self._setup(fmt, tensors, shape, dtype)
        self.padding_idx = padding_idx
        self.num_embeddings, self.embedding_dim = self.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        d_out, d_in = self.shape
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= d_out):
            raise IndexError(f"index out of range in self: ids in [{int(ids.min())}, {int(ids.max())}], "
                             f"{d_out} embeddings")
        tensors = self.packed_tensors
        rows = _block_rows(self.shape)
        if self.format.row_block(tensors, self.shape, 0, min(rows, d_out)) is None:
            return F.embedding(ids, self.weight, self.padding_idx)
        unique, inverse = torch.unique(ids, return_inverse=True)
        gathered = torch.empty(unique.numel(), d_in, dtype=self.weight_dtype, device=ids.device)
        blocks = unique // rows
        for b in torch.unique(blocks).tolist():
            r0 = b * rows
            part, part_shape = self.format.row_block(tensors, self.shape, r0, min(r0 + rows, d_out))
            decoded = self.format.unpack(part, part_shape).to(self.weight_dtype)
            where = (blocks == b).nonzero().reshape(-1)
            gathered[where] = decoded[unique[where] - r0]
        return gathered[inverse.reshape(ids.shape)]


KERNELS = ("torch", "native")
DECODES = ("eager", "lazy")


def check_kernel(kernel: str, fmt: FormatBase, act_quant: bool = True) -> None:
    """``kernel="native"`` needs a format the native kernels run, with INT8 activations."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r}: expected one of {', '.join(KERNELS)}")
    if kernel == "native" and not (fmt.native_kernel and act_quant):
        raise ValueError(f"kernel 'native' runs formats with a native kernel and INT8 activations only "
                         f"(format {fmt.name!r}, act_quant={act_quant})")


def check_finite(path, key: str, t: torch.Tensor, positive: bool = False) -> None:
    """Every value of tensor ``key`` finite (and > 0 with ``positive``), else a ValueError naming the first."""
    if not t.numel():
        return
    ok = torch.isfinite(t)
    if positive:
        ok &= t > 0
    if not bool(ok.all()):
        index = (~ok).nonzero()[0].tolist()
        value = float(t[tuple(index)])
        rule = "finite and > 0" if positive else "finite"
        raise ValueError(f"{path}: tensor {key!r} must be {rule}, got {value} at index {index}")


def packed_layer(path, saved: str, fmt: FormatBase, tensors: dict[str, torch.Tensor], shape: tuple[int, int],
                 bias: torch.Tensor | None, padding_idx: int | None, *, linear: bool, kernel: str, decode: str,
                 act_quant: bool, dtype: torch.dtype) -> nn.Module:
    """The module that replaces a Linear (``linear``) or an Embedding whose weight ``saved`` of file ``path`` is
    the packed ``tensors``: scales finite and > 0, every byte decoded once (eager) or validated
    block by block (lazy, native), then the eager, lazy or native module (an embedding on the native kernels:
    the format's ``row_embedding``). Errors name the file and tensor."""
    if "scale" in tensors:
        check_finite(path, f"{saved}.scale", tensors["scale"].float(), positive=True)
    native = linear and kernel == "native"
    try:
        if decode == "eager" and not native:
            weight = fmt.unpack(tensors, shape).to(dtype)
        else:
            _validate_blockwise(fmt, tensors, shape)
    except ValueError as e:
        raise ValueError(f"{path}: tensor {saved!r}: {e}") from None
    if native:          # the packed bytes through the native kernels (INT8 activations per token)
        return fmt.native_linear({s: t.cpu() for s, t in tensors.items()}, shape, bias)
    if kernel == "native" and decode == "lazy" and fmt.native_kernel:   # the looked-up rows by the native decode
        return fmt.row_embedding(tensors, shape, padding_idx, dtype)
    if decode == "eager":
        return PackedLinear(weight, bias, act_quant) if linear else PackedEmbedding(weight, padding_idx)
    if linear:
        return LazyPackedLinear(fmt, tensors, shape, bias, act_quant, dtype)
    return LazyPackedEmbedding(fmt, tensors, shape, padding_idx, dtype)
