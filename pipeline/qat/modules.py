"""Fake-quantised ``nn.Linear`` and ``nn.Embedding`` (SPEC section 4).

The fp32 master weight stays a plain parameter under its original name (so checkpoints keep the
teacher's layout); every forward quantises it with the format's frozen state, scales recomputed from
the master, and a straight-through gradient. Linear inputs go through the INT8 activation quantiser
when ``act_quant`` is on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.formats import FormatBase, State
from pipeline.quant import fake_quant_activations
from pipeline.recipe import Quantised


class _FakeQuant(Quantised):
    def _setup(self, fmt: FormatBase, state: State) -> None:
        self.format = fmt
        self.state_names = sorted(state)
        for key in self.state_names:
            # Not persistent: the state lives in the fitted-state file, not in the checkpoint.
            self.register_buffer(f"qstate_{key}", state[key].clone(), persistent=False)

    @property
    def qstate(self) -> State:
        return {key: getattr(self, f"qstate_{key}") for key in self.state_names}

    def quantized_weight(self) -> torch.Tensor:
        return self.format.quantize(self.weight, self.qstate)


class QuantLinear(_FakeQuant):
    def __init__(self, linear: nn.Linear, fmt: FormatBase, state: State, act_quant: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.act_quant = act_quant
        self._setup(fmt, state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_quant:
            x = fake_quant_activations(x)
        return F.linear(x, self.quantized_weight(), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.format.name}, act_quant={self.act_quant}")


class QuantEmbedding(_FakeQuant):
    def __init__(self, embedding: nn.Embedding, fmt: FormatBase, state: State) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.weight = embedding.weight
        self._setup(fmt, state)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.quantized_weight(), self.padding_idx)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.format.name}"
