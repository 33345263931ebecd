"""The teacher's logits at the response positions of sequences (the ``loss_mask`` of
:func:`pipeline.teacher.answers.collate`): the one source QAT's loss and the evaluations' KL read them from.

:class:`TeacherLogits` keeps them per example, computed once (QAT's ``qat.teacher_logits: cache``; the text
evaluation's held-out answers), or computes a batch's rows when they are asked for (``forward``: QAT at 11B, where
the cache would not fit, and the image evaluation's held-out answers, which stream).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from pipeline.teacher.answers import Example, collate, model_inputs
from pipeline.stage import progress


def model_logits(model, batch: dict, dtype: torch.dtype | None = None, device=None,
                 keep: torch.Tensor | None = None) -> torch.Tensor:
    """``model``'s logits ``[B, L, V]`` of a :func:`~pipeline.teacher.answers.collate` batch (its ``loss_mask`` left
    out), the image pixels in ``dtype`` (the model's own by default), the inputs moved to ``device`` when given.
    With ``keep`` (``[B, L]`` bool): only the rows at its positions, ``[N, V]`` (:func:`head_rows`)."""
    inputs = model_inputs(batch, dtype or model.dtype, device)
    if keep is None:
        return model(**inputs).logits
    with head_rows(model, keep):
        return model(**inputs).logits


@contextmanager
def head_rows(model, keep: torch.Tensor):
    """Within it, ``model``'s output head (``get_output_embeddings()``, the one module that turns hidden states into
    logits in transformers' Llama and Mllama) reads only the hidden states at ``keep`` (``[B, L]`` bool): the
    logits come out ``[N, V]`` in ``logits[keep]``'s order, and the head's product, the logits and their gradient
    cost N rows instead of B x L (a QAT answer batch: about half its positions are the prompt's)."""
    head = getattr(model, "module", model).get_output_embeddings()

    def select(_module, args):
        return (args[0][keep.to(args[0].device)], *args[1:])

    handle = head.register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()


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
                    logits = self.forward(batch)
                    self.cached.extend(r.clone() for r in logits.split(batch["loss_mask"].sum(1).tolist()))
                    bar.advance(task, len(batch["loss_mask"]))

    @torch.no_grad()
    def forward(self, batch: dict) -> torch.Tensor:
        """The teacher's logits at ``batch``'s response positions ``[N, V]``, in mask order."""
        return model_logits(self.teacher, batch, self.dtype, self.device, keep=batch["loss_mask"].bool())

    def rows(self, batch: dict, indices: list[int] | None = None) -> torch.Tensor:
        """The teacher's logits at ``batch``'s response positions ``[N, V]``, in mask order: the cached rows of the
        examples ``indices`` (the batch's, in order), or the teacher's forward of ``batch``."""
        if self.cached is not None:
            if indices is None:
                raise ValueError("cached teacher logits: name the batch's examples")
            return torch.cat([self.cached[i] for i in indices])
        return self.forward(batch)

    def __getitem__(self, index: int) -> torch.Tensor:
        """The cached rows of example ``index``."""
        if self.cached is None:
            raise ValueError("teacher logits: nothing cached (built without examples)")
        return self.cached[index]
