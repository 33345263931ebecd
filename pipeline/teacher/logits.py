"""The teacher's logits at the response positions of sequences (the ``loss_mask`` of
:func:`pipeline.teacher.answers.collate`): the one source QAT's loss and the evaluations' KL read them from.

:class:`TeacherLogits` keeps them per example, computed once (QAT's ``qat.teacher_logits: cache``; the text
evaluation's held-out answers), or computes a batch's rows when they are asked for (``forward``: QAT at 11B, where
the cache would not fit, and the image evaluation's held-out answers, which stream).
"""

from __future__ import annotations

import torch

from pipeline.teacher.answers import Example, collate, model_inputs
from pipeline.stage import progress


def model_logits(model, batch: dict, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
    """``model``'s logits ``[B, L, V]`` of a :func:`~pipeline.teacher.answers.collate` batch (its ``loss_mask`` left
    out), the image pixels in ``dtype`` (the model's own by default), the inputs moved to ``device`` when given."""
    return model(**model_inputs(batch, dtype or model.dtype, device)).logits


class TeacherLogits:
    """The teacher's logits at every response position, in the dtype it outputs them (bf16 rows of a bf16 teacher,
    bit for bit). With ``examples``: each example's rows ``[n_i, V]``, computed once by one forward per
    ``batch_size`` examples in example order (a pure function of the examples and parameters; every process
    computes all of them, as a sharded teacher's forward is collective). Without: :meth:`rows` runs the teacher on
    the batch it is given. Batched and padded otherwise than a later batch, a cached row may differ from that
    batch's forward in the last bits of bf16 (tests/test_qat.py bounds it)."""

    def __init__(self, teacher, dtype: torch.dtype | None = None, examples: list[Example] | None = None,
                 processor=None, max_seq_len: int | None = None, batch_size: int = 1, device=None,
                 what: str = "teacher logits") -> None:
        self.teacher, self.dtype, self.device = teacher, dtype, device
        self.cached: list[torch.Tensor] | None = None
        if examples is not None:
            self.cached = []
            with progress() as bar:
                task = bar.add_task(what, total=len(examples))
                for a in range(0, len(examples), batch_size):
                    batch = collate(examples[a:a + batch_size], processor, max_seq_len)
                    keep = batch["loss_mask"].bool()
                    logits = self.forward(batch)
                    self.cached.extend(logits[i][keep[i].to(logits.device)].clone() for i in range(len(keep)))
                    bar.advance(task, len(keep))

    @torch.no_grad()
    def forward(self, batch: dict) -> torch.Tensor:
        """The teacher's logits ``[B, L, V]`` of ``batch``."""
        return model_logits(self.teacher, batch, self.dtype, self.device)

    def rows(self, batch: dict, indices: list[int] | None = None) -> torch.Tensor:
        """The teacher's logits at ``batch``'s response positions ``[N, V]``, in mask order: the cached rows of the
        examples ``indices`` (the batch's, in order), or the teacher's forward of ``batch``."""
        if self.cached is not None:
            if indices is None:
                raise ValueError("cached teacher logits: name the batch's examples")
            return torch.cat([self.cached[i] for i in indices])
        logits = self.forward(batch)
        return logits[batch["loss_mask"].bool().to(logits.device)]

    def __getitem__(self, index: int) -> torch.Tensor:
        """The cached rows of example ``index``."""
        if self.cached is None:
            raise ValueError("teacher logits: nothing cached (built without examples)")
        return self.cached[index]
