"""An exact rotation of a Llama's residual stream (a text Llama's, or an Mllama language model's), done offline, so
that its matrices quantise better and the model computes the same function.

With ``h`` the residual stream (a row vector) and ``Q`` orthogonal, the rotated model carries ``h Q`` instead:

- each RMSNorm weight ``g`` is folded into the matrices that read its output (``W <- W diag(g)``) and set to 1: an
  RMSNorm without weight commutes with ``Q`` (``|h Q| = |h|``);
- matrices that read the stream (``q/k/v_proj``, ``gate/up_proj``, ``lm_head``) become ``W Q``; those that write it
  (``o_proj``, ``down_proj``) ``Q^T W``; the token embedding ``E Q``.

Outliers of the stream (a few channels ~100x the rest) are spread over every channel, so no row's scale is set by
one of them. The result is an ordinary ``LlamaForCausalLM`` / ``MllamaForConditionalGeneration`` (transformers and our
runtime run it unchanged) whose logits equal the original's to float32 rounding (tested). A tied output head cannot
stay tied (the embedding is ``E Q``, the head ``E diag(g_final) Q``): the head becomes a matrix of its own, one more
vocabulary-sized matrix to store. ``orthogonal``: ``Q`` from the QR decomposition of a seeded Gaussian matrix;
``hadamard``: a Hadamard matrix (every entry +-1/sqrt(d), so no channel of the stream can stay an outlier) with seeded
random row signs, QuaRot's choice, built as Kronecker products of Sylvester's and Paley's constructions: orders 2^k
times a product of Paley orders q + 1 (q a prime, 3 mod 4) and 2(q + 1) (q a prime, 1 mod 4), e.g. 576 = 4 x 12 x 12
(SmolLM2-135M), 1280 = 64 x 20 (Mllama's vision tower), 3072 = 256 x 12, 4096 = 2^12.
"""

from __future__ import annotations

import math

import torch
from torch import nn

KINDS = ("none", "orthogonal", "hadamard")
MODEL_TYPES = ("llama", "mllama")
"""The ``model_type`` values :func:`rotate_llama` rotates."""


def rotation(kind: str, d: int, seed: int = 0) -> torch.Tensor:
    """The float64 ``[d, d]`` orthogonal matrix of ``kind``."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "orthogonal":
        q, r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
        return q * torch.sign(torch.diagonal(r))[None, :]
    if kind == "hadamard":
        h = hadamard(d)
        if h is None:
            raise ValueError(f"rotate hadamard: no Hadamard matrix of order {d} is built here (2^k times Paley orders; "
                             "use orthogonal)")
        signs = torch.randint(0, 2, (d,), generator=gen).double() * 2 - 1
        return signs[:, None] * h / math.sqrt(d)
    raise ValueError(f"rotate {kind!r}: expected one of {', '.join(KINDS)}")


def _prime(n: int) -> bool:
    return n > 1 and all(n % p for p in range(2, math.isqrt(n) + 1))


def _paley(n: int) -> torch.Tensor | None:
    """Paley's Hadamard matrix of order ``n`` (float64 +-1), or None: construction I for ``n = q + 1``, construction
    II for ``n = 2(q + 1)``, from the quadratic characters of GF(q), q a prime."""
    def core(q: int) -> torch.Tensor:                   # [[0, 1^T], [+-1, Jacobsthal]] of order q + 1
        squares = {i * i % q for i in range(1, q)}
        chi = torch.tensor([0.0] + [1.0 if i in squares else -1.0 for i in range(1, q)], dtype=torch.float64)
        idx = torch.arange(q)
        c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
        c[0, 1:] = 1
        c[1:, 0] = 1 if q % 4 == 1 else -1
        c[1:, 1:] = chi[(idx[None, :] - idx[:, None]) % q]
        return c
    if _prime(n - 1) and (n - 1) % 4 == 3:
        return core(n - 1) + torch.eye(n, dtype=torch.float64)
    if n % 2 == 0 and _prime(n // 2 - 1) and (n // 2 - 1) % 4 == 1:
        zero = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        one = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        c = core(n // 2 - 1)
        return torch.kron(c, one) + torch.kron((c == 0).double(), zero)
    return None


def hadamard(n: int) -> torch.Tensor | None:
    """A Hadamard matrix of order ``n`` (float64 +-1, ``H H^T = n I``), or None where none is built here: Sylvester's
    ``[[H, H], [H, -H]]``, Paley's constructions, and Kronecker products of those."""
    if n & (n - 1) == 0:                                  # Sylvester's, for every power of 2
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return h
    if n % 4:
        return None                                        # no Hadamard matrix has such an order
    direct = _paley(n)
    if direct is not None:
        return direct
    for a in range(12, n // 2 + 1, 4):                  # a Paley factor times what is left
        if n % a == 0:
            left = _paley(a)
            right = hadamard(n // a) if left is not None else None
            if right is not None:
                return torch.kron(left, right)
    return None


def _set(module: nn.Module, weight: torch.Tensor) -> None:
    module.weight.data = weight.to(module.weight.dtype).contiguous()


def _text_model(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """``(decoder body, output head)`` of a ``LlamaForCausalLM`` or of an ``MllamaForConditionalGeneration``'s
    language model; ValueError for anything else."""
    kind = getattr(model.config, "model_type", None)
    if kind not in MODEL_TYPES:
        raise ValueError(f"rotate: only a text Llama or an Mllama's language model is rotated (this is {kind!r})")
    return (model.model if kind == "llama" else model.model.language_model), model.lm_head


def auto_rotation(config) -> str:
    """``s3d8 pack --rotate auto``: hadamard for a text Llama or an Mllama's language model whose width has a Hadamard
    matrix here (its casts had a lower KL than orthogonal ones at two seeds each: reports/smollm2-135m/rotation-casts),
    orthogonal for the other widths, none for other models."""
    if getattr(config, "model_type", None) not in MODEL_TYPES:
        return "none"
    text = config.text_config if config.model_type == "mllama" else config
    return "hadamard" if hadamard(text.hidden_size) is not None else "orthogonal"


def rotate_llama(model: nn.Module, kind: str, seed: int = 0) -> None:
    """Rotate a ``LlamaForCausalLM``, or the language model of an ``MllamaForConditionalGeneration``, in place
    (module doc); ``none`` leaves it as it is. Mllama: a cross-attention layer's ``q_proj`` reads the stream and its
    ``o_proj`` writes it (its scalar gates commute with ``Q``); its ``k_proj`` / ``v_proj`` read the image states, not
    the stream, and stay as they are, as do the vision tower and the projector (the vision tower's LayerNorms, which
    subtract a mean and add a bias, do not commute with a rotation)."""
    if kind == "none":
        return
    body, head = _text_model(model)
    q = rotation(kind, body.config.hidden_size, seed)
    with torch.no_grad():
        if head.weight is body.embed_tokens.weight or getattr(model.config, "tie_word_embeddings", False):
            head.weight = nn.Parameter(body.embed_tokens.weight[:head.out_features].detach().clone())
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
            f = layer.mlp
            if hasattr(layer, "cross_attn"):
                reads([layer.cross_attn.q_proj], layer.input_layernorm)
                writes(layer.cross_attn.o_proj)
            else:
                a = layer.self_attn
                reads([a.q_proj, a.k_proj, a.v_proj], layer.input_layernorm)
                writes(a.o_proj)
            reads([f.gate_proj, f.up_proj], layer.post_attention_layernorm)
            writes(f.down_proj)
        reads([head], body.norm)
