"""Fake-quantised ``nn.Linear`` and ``nn.Embedding`` (SPEC section 4).

The fp32 master weight stays a plain parameter under its original name (so checkpoints keep the
teacher's layout); every forward quantises it with the format's frozen state, scales recomputed from
the master, and a straight-through gradient. Linear inputs go through the INT8 activation quantiser
when ``act_quant`` is on.

With learned scales (``qat.learn_scales``) the scale is a parameter of its own, ``<module>.qat_log2_scale``
(float32 ``log2`` of the scale, as ``fmt.absmax_scale`` lays it out: per row for S3D8, per block for a
6-level format; in the log domain an optimizer step changes every scale by the same ratio, whatever its
magnitude, and a scale never reaches 0), used as ``bf16(2^p)``, exactly what the packed file stores; the
codes are the nearest centroid / code point of the master over that scale, and the gradient is LSQ's
(Esser et al. 2020): ``d q / d w = 1`` (straight through), ``d q / d s = t - w / s`` with ``t`` the code
value in units of the scale.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.formats import FormatBase, State
from pipeline.quant import fake_quant_activations
from pipeline.recipe import Quantised


def learned_scale(log2_scale: torch.Tensor) -> torch.Tensor:
    """The bf16 scale a trained ``log2`` scale stands for, floored at the smallest normal scale."""
    return torch.exp2(log2_scale.detach().float().clamp(min=-126)).to(torch.bfloat16)


def log2_scale(scale: torch.Tensor) -> torch.Tensor:
    """The parameter for a bf16 scale: ``learned_scale(log2_scale(s)) == s`` for every normal bf16 ``s``."""
    return torch.log2(scale.detach().float())


def quantize_learned(fmt: FormatBase, weight: torch.Tensor, state: State, log2: torch.Tensor) -> torch.Tensor:
    """Fake-quantised ``weight`` at a trained scale ``2^log2`` (used as ``learned_scale(log2)``): equal bit for
    bit to unpacking ``fmt.pack_at_scale(weight, state, learned_scale(log2))``, with LSQ's gradients to
    the weight and the scale."""
    s16 = learned_scale(log2)
    t = fmt.values_at_scale(weight, state, s16)        # the codes' values, no gradient
    q = t * fmt.expand_scale(s16.float(), weight.shape)
    return _LSQ.apply(weight, fmt.expand_scale(log2, weight.shape), q.to(weight.dtype))


class _LSQ(torch.autograd.Function):
    """Forward ``q``; backward ``d/dw = 1`` and, per weight, ``d/dlog2(s) = ln 2 * s * (t - w / s) = ln 2 * (q - w)``
    (LSQ's scale gradient in the log domain: well defined at any scale), summed by autograd over each row or
    block the scale was expanded from."""

    @staticmethod
    def forward(ctx, weight, log2_expanded, q):
        ctx.save_for_backward(q.float() - weight.detach().float())
        return q

    @staticmethod
    def backward(ctx, grad):
        (err,) = ctx.saved_tensors
        return grad, (grad.float() * err * math.log(2)), None


class _FakeQuant(Quantised):
    def _setup(self, fmt: FormatBase, state: State, scale: torch.Tensor | None = None) -> None:
        self.format = fmt
        self.state_names = sorted(state)
        for key in self.state_names:
            # Not persistent: the state lives in the fitted-state file, not in the checkpoint.
            self.register_buffer(f"qstate_{key}", state[key].clone(), persistent=False)
        self.qat_log2_scale = None if scale is None else nn.Parameter(log2_scale(scale))

    @property
    def qstate(self) -> State:
        return {key: getattr(self, f"qstate_{key}") for key in self.state_names}

    def quantized_weight(self) -> torch.Tensor:
        """The fake-quantised weight, computed in float32 from the master and the scale whatever the compute
        dtype (autocast off; FSDP2 gathers these modules in fp32): training optimises the values the packer
        writes. Its consumer casts it to its own dtype."""
        with torch.autocast(self.weight.device.type, enabled=False):
            weight = self.weight.float()
            if self.qat_log2_scale is None:
                return self.format.quantize(weight, self.qstate)
            return quantize_learned(self.format, weight, self.qstate, self.qat_log2_scale.float())


class QuantLinear(_FakeQuant):
    def __init__(self, linear: nn.Linear, fmt: FormatBase, state: State, act_quant: bool,
                 scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.act_quant = act_quant
        self._setup(fmt, state, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.quantized_weight()
        if self.act_quant:          # the INT8 activation quantiser in float32 too; the product in x's dtype
            x = fake_quant_activations(x.float()).to(x.dtype)
        return F.linear(x, weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.format.name}, act_quant={self.act_quant}")


class QuantEmbedding(_FakeQuant):
    def __init__(self, embedding: nn.Embedding, fmt: FormatBase, state: State,
                 scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.weight = embedding.weight
        self._setup(fmt, state, scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.quantized_weight(), self.padding_idx)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.format.name}"
