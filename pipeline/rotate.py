"""An exact rotation of a Llama's residual stream, done offline, so that its matrices quantise better and the model
computes the same function.

With ``h`` the residual stream (a row vector) and ``Q`` orthogonal, the rotated model carries ``h Q`` instead:

- each RMSNorm weight ``g`` is folded into the matrices that read its output (``W <- W diag(g)``) and set to 1: an
  RMSNorm without weight commutes with ``Q`` (``|h Q| = |h|``);
- matrices that read the stream (``q/k/v_proj``, ``gate/up_proj``, ``lm_head``) become ``W Q``; those that write it
  (``o_proj``, ``down_proj``) ``Q^T W``; the token embedding ``E Q``.

Outliers of the stream (a few channels ~100x the rest) are spread over every channel, so no row's scale is set by
one of them. The result is an ordinary ``LlamaForCausalLM`` (transformers and our runtime run it unchanged) whose
logits equal the original's to float32 rounding (tested). A tied output head cannot stay tied (the embedding is
``E Q``, the head ``E diag(g_final) Q``): the head becomes a matrix of its own, one more vocabulary-sized matrix to
store. ``orthogonal``: ``Q`` from the QR decomposition of a seeded Gaussian matrix; ``hadamard``: a Sylvester
Hadamard matrix with seeded random signs (the hidden size a power of 2).
"""

from __future__ import annotations

import math

import torch
from torch import nn

KINDS = ("none", "orthogonal", "hadamard")


def rotation(kind: str, d: int, seed: int = 0) -> torch.Tensor:
    """The float64 ``[d, d]`` orthogonal matrix of ``kind``."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "orthogonal":
        q, r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
        return q * torch.sign(torch.diagonal(r))[None, :]
    if kind == "hadamard":
        if d & (d - 1):
            raise ValueError(f"rotate hadamard: hidden size {d} is not a power of 2 (use orthogonal)")
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (d,), generator=gen).double() * 2 - 1
        return signs[:, None] * h / math.sqrt(d)
    raise ValueError(f"rotate {kind!r}: expected one of {', '.join(KINDS)}")


def _set(module: nn.Module, weight: torch.Tensor) -> None:
    module.weight.data = weight.to(module.weight.dtype).contiguous()


def rotate_llama(model: nn.Module, kind: str, seed: int = 0) -> None:
    """Rotate a ``LlamaForCausalLM`` in place (module doc); ``none`` leaves it as it is."""
    if kind == "none":
        return
    if getattr(model.config, "model_type", None) != "llama":
        raise ValueError(f"rotate {kind}: only a text Llama is rotated (this is {model.config.model_type!r})")
    body = model.model
    q = rotation(kind, model.config.hidden_size, seed)
    with torch.no_grad():
        if model.lm_head.weight is body.embed_tokens.weight or model.config.tie_word_embeddings:
            model.lm_head.weight = nn.Parameter(body.embed_tokens.weight.detach().clone())
            model.config.tie_word_embeddings = False
        if hasattr(model, "all_tied_weights_keys"):
            model.all_tied_weights_keys = {}

        def reads(linears, norm):
            g = norm.weight.double()
            for m in linears:                  # a bias is added after the product: unchanged
                _set(m, (m.weight.double() * g[None, :]) @ q)
            norm.weight.data.fill_(1.0)

        def writes(m):
            _set(m, q.T @ m.weight.double())
            if m.bias is not None:
                m.bias.data = (q.T @ m.bias.double()).to(m.bias.dtype)

        _set(body.embed_tokens, body.embed_tokens.weight.double() @ q)
        for layer in body.layers:
            a, f = layer.self_attn, layer.mlp
            reads([a.q_proj, a.k_proj, a.v_proj], layer.input_layernorm)
            writes(a.o_proj)
            reads([f.gate_proj, f.up_proj], layer.post_attention_layernorm)
            writes(f.down_proj)
        reads([model.lm_head], body.norm)
