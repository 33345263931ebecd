"""KL(teacher || student) of next-token distributions: the one definition QAT's loss (response tokens only) and
every evaluation (held-out answers, text windows) use."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def response_kl_sum(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
    """Sum over masked positions of ``KL(p_teacher || p_student)``.

    ``*_logits`` are ``[B, L, V]`` (position t predicts token t+1); ``mask [B, L]`` is 1 where the
    predicted token is a response token. The caller divides by the response-token count of the
    global batch (all micro-batches and processes), as the recipe prescribes.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {list(student_logits.shape)} and teacher logits "
                         f"{list(teacher_logits.shape)} differ in shape")
    keep = mask.bool()
    return kl_sum(student_logits[keep], teacher_logits[keep])


def kl_sum(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Sum over rows of ``KL(p_teacher || p_student)`` for logits already selected, ``[N, V]`` each (the
    masked positions of :func:`response_kl_sum`, in the same order; QAT's cached teacher logits)."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {list(student_logits.shape)} and teacher logits "
                         f"{list(teacher_logits.shape)} differ in shape")
    s = F.log_softmax(student_logits.float(), dim=-1)
    t = F.log_softmax(teacher_logits.float(), dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="sum")
