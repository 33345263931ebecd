"""Numerics that the formats' post-training methods share: the clipping grid of the scale search, bf16 scale
candidates, the least-squares scale given codes, and GPTQ's error feedback (Frantar et al. 2022).

Each format's own search and GPTQ grouping (which weights share a scale, how a column is rounded) live in its
module (``pipeline.formats.s3d8``, ``pipeline.formats.scalar``); ``pipeline.cast.ptq`` chooses the method.
"""

from __future__ import annotations

import torch

ALPHAS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.6)   # clipping grid (least squares refines in between)
KAPPAS = (6.0, 5.0, 4.0, 3.5, 3.0)   # clipping at kappa x the row's RMS (S3D8: see s3d8.search_scales)
ROUNDS = 3                    # (scale search, table or code-point refit) alternations
LS_STEPS = 2                  # least-squares scale refinements after each grid search
KMEANS_VECTORS = 2 ** 18      # vectors a table refit uses at most (a seeded sample beyond)
GPTQ_BLOCK = 128
GPTQ_DAMP = 0.01
GPTQ_ACT_ORDER = False
"""The default of every ``act_order`` argument (parameter ``calibrate.act_order``, ``s3d8 pack --act-order``): with it,
columns in order of decreasing ``H[k, k]`` (GPTQ's ``act_order``, GPTQModel's ``desc_act``): the columns that
carry the most signal are rounded first, while the most later columns remain to take up their error. Every
format's scales are fixed before the error feedback (per row, or per block from the search: ``static_groups``), so
the order changes which codes are chosen, never the layout."""

SMALLEST_SCALE = 2.0 ** -126
"""The smallest normal float (exact in bf16): the scale of an all-zero row or block (SPEC section 1), so it
decodes to ~0."""


def weights(importance: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
    """Per-input-channel weights of the squared error of ``weight``: ``importance``, or all ones."""
    return torch.ones(weight.shape[1], device=weight.device) if importance is None else importance.to(weight.device)


def bf16_scale(value: torch.Tensor) -> torch.Tensor:
    """``bf16(max(value, SMALLEST_SCALE))`` (NaN -> SMALLEST_SCALE): a valid scale for any candidate value."""
    v = torch.nan_to_num(value.float(), nan=SMALLEST_SCALE, posinf=SMALLEST_SCALE,
                         neginf=SMALLEST_SCALE).clamp(min=SMALLEST_SCALE)
    return v.to(torch.bfloat16)


def least_squares_scale(w: torch.Tensor, t: torch.Tensor, h: torch.Tensor, current: torch.Tensor,
                        keepdim: bool = False) -> torch.Tensor:
    """The bf16 scale ``s = <w, t>_h / <t, t>_h`` over the last dimension (codes ``t`` kept), or ``current`` where
    that is not a positive number."""
    num, den = (w * t * h).sum(-1, keepdim=keepdim), (t * t * h).sum(-1, keepdim=keepdim)
    return bf16_scale(torch.where((den > 0) & (num > 0), num / den.clamp(min=1e-30), current.float()))


def gptq(weight: torch.Tensor, hessian: torch.Tensor, quant_col, *, block: int = GPTQ_BLOCK,
         damp: float = GPTQ_DAMP, act_order: bool = GPTQ_ACT_ORDER) -> torch.Tensor:
    """GPTQ error feedback (lazy block updates): columns one at a time (by decreasing ``H[k, k]`` with
    ``act_order``, else in index order), each quantised by ``quant_col(k, column) -> quantised column`` (``k`` the
    column's own index) and its error spread over the later columns through the upper Cholesky factor of ``H^-1``
    (``H`` damped by ``damp * mean(diag H)``). Input channels that never carry signal (``H[k, k] == 0``) are set
    to zero first. Returns the quantised weight."""
    w = weight.detach().float().clone()
    h = hessian.detach().double().clone()
    d_in = w.shape[1]
    dead = h.diagonal() == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * h.diagonal().mean() * torch.eye(d_in, dtype=torch.float64, device=h.device)
    order = (torch.argsort(h.diagonal(), descending=True, stable=True) if act_order
             else torch.arange(d_in, device=h.device))
    w, h, cols = w[:, order], h[order][:, order], order.tolist()
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    q = torch.zeros_like(w)
    for i1 in range(0, d_in, block):
        i2 = min(i1 + block, d_in)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = w1[:, i]
            qc = quant_col(cols[i1 + i], col)
            q[:, cols[i1 + i]] = qc
            e = (col - qc) / u1[i, i]
            w1[:, i:] -= e[:, None] * u1[i, i:][None, :]
            err1[:, i] = e
        w[:, i2:] -= err1 @ u[i1:i2, i2:]
    return q
