"""KL(teacher || model) per response token on held-out teacher answers: how far a quantised model's next-token
distributions are from the teacher's, below what task scores resolve."""

from __future__ import annotations

import torch

from pipeline.teacher.answers import collate
from pipeline.divergence import kl_sum
from pipeline.teacher.logits import TeacherLogits, model_logits


class HeldoutKL:
    """Streams: the teacher's logits are recomputed batch by batch beside the model's (:class:`TeacherLogits`
    without a cache), so memory holds one batch of logits of each, whatever the number of held-out prompts (at 11B
    a cache of every teacher logit would take ~134 GB)."""

    def __init__(self, teacher, processor, examples, batch_size: int, max_seq_len: int) -> None:
        if batch_size < 1:
            raise ValueError(f"parameter eval.kl_batch_size={batch_size}: must be >= 1")
        self.teacher = TeacherLogits(teacher, device=teacher.device)
        self.batches = [collate(examples[i:i + batch_size], processor, max_seq_len)
                        for i in range(0, len(examples), batch_size)]

    @torch.inference_mode()
    def __call__(self, model) -> float:
        if not self.batches:
            return float("nan")
        total = tokens = 0.0
        for batch in self.batches:
            student = model_logits(model, batch, device=model.device, keep=batch["loss_mask"].bool())
            total += kl_sum(student, self.teacher.rows(batch).to(student.device)).item()
            tokens += int(batch["loss_mask"].sum())
        return total / tokens
