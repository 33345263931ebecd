"""KL(teacher || student) of next-token distributions: the one definition QAT's loss (response tokens only) and
every evaluation (held-out answers, text windows) use.

It runs over row blocks of at most ``CHUNK`` logits, forward and backward: a real vocabulary makes each row
long (SmolLM2 49,152, Llama 3 128,256), and the whole-batch ``log_softmax`` / ``kl_div`` of ``N`` rows made four
fresh ``N x V`` float32 temporaries a step, each page-faulted in anew (a window batch of 8 x 192 tokens: 300 MB
each). Block by block the temporaries stay small and are reused; the backward recomputes the softmaxes from the
two logit tensors instead of keeping them. The arithmetic is ``kl_div``'s (``exp(t) * (t - s)`` with
``log_softmax`` on both sides) and its gradient autograd's of that graph; only the order of the sum differs.
"""

from __future__ import annotations

import torch

CHUNK = 1 << 20          # logits per block (4 MB of float32 per temporary: 1.4x faster than 16 MB here)


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
    masked positions of :func:`response_kl_sum`, in the same order; QAT's cached teacher logits). A float32
    scalar; differentiable in the student's logits (the teacher's are a fixed target)."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {list(student_logits.shape)} and teacher logits "
                         f"{list(teacher_logits.shape)} differ in shape")
    return _BlockKL.apply(student_logits, teacher_logits.detach())


def _blocks(n: int, v: int):
    rows = max(1, CHUNK // max(v, 1))
    return ((a, min(a + rows, n)) for a in range(0, n, rows))


class _BlockKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(student, teacher)
        total = torch.zeros((), dtype=torch.float64, device=student.device)
        for a, b in _blocks(student.shape[0], student.shape[-1]):
            s = torch.log_softmax(student[a:b].float(), -1)
            t = torch.log_softmax(teacher[a:b].float(), -1)
            total += (t.exp() * (t - s)).sum(dtype=torch.float64)
        return total.float()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        student, teacher = ctx.saved_tensors
        out = torch.empty_like(student)
        for a, b in _blocks(student.shape[0], student.shape[-1]):
            p_t = torch.log_softmax(teacher[a:b].float(), -1).exp_()
            # d/ds of sum(p_t * (log p_t - log_softmax(s))): log_softmax's backward of the upstream -p_t
            g = torch.softmax(student[a:b].float(), -1).mul_(p_t.sum(-1, keepdim=True)).sub_(p_t)
            out[a:b] = g.mul_(grad)
        return out, None
