"""The text evaluation of a text-only teacher (Llama, e.g. SmolLM2): KL to the teacher and top-1 agreement on
held-out teacher answers, and perplexity on real human-written English that every machine has.

The perplexity corpus is the held-out half of the Python Language Reference's prose (:mod:`pipeline.texts`).

One code path scores every model, ours or llama.cpp's: a model is a ``logits_fn(ids) -> [len(ids), vocab]``
float32 tensor of the logits at every position of one sequence (no batching, no padding), and
:class:`TextReference` holds the teacher's side, computed once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pipeline.divergence import kl_sum
from pipeline.teacher.logits import TeacherLogits
from pipeline.texts import (CORPUS, HELDOUT_EVERY, corpus_info, corpus_text,  # noqa: F401  (also imported from here)
                            corpus_windows, text_windows)

LogitsFn = Callable[[list[int]], torch.Tensor]


def hf_logits_fn(model) -> LogitsFn:
    """``logits_fn`` of a Hugging Face causal LM (float32 logits of one unpadded sequence)."""
    @torch.inference_mode()
    def logits(ids: list[int]) -> torch.Tensor:
        out = model(input_ids=torch.tensor([ids], device=model.device)).logits[0]
        return out.float().cpu()
    return logits


@dataclass
class _Sequence:
    ids: list[int]
    start: int                        # first position whose next token is scored
    teacher: torch.Tensor | None      # the teacher's logits at the scored positions (as it outputs them)


class TextReference:
    """The teacher's side of the text evaluation, computed once: its logits on the held-out answers (kept in the
    dtype the teacher outputs them, bf16 for a bf16 teacher: exact) and the perplexity windows."""

    def __init__(self, answers: list[_Sequence], windows: list[list[int]], teacher_dtype: str) -> None:
        self.answers, self.windows, self.teacher_dtype = answers, windows, teacher_dtype

    @classmethod
    def build(cls, teacher_model, tokenizer, heldout_examples: Sequence, windows: list[list[int]],
              max_seq_len: int | None = None) -> TextReference:
        """``heldout_examples``: :class:`pipeline.teacher.answers.Example` (prompt ids, then the teacher's answer ids);
        each sequence is cut to ``max_seq_len`` tokens when given. ``tokenizer``: the teacher's, or None (one
        sequence per forward: nothing is padded). The logits come from
        :class:`pipeline.teacher.logits.TeacherLogits`."""
        longest = max((len(e.prompt_ids) + len(e.response_ids) for e in heldout_examples), default=0)
        limit = max_seq_len or longest + 1
        scored = [e for e in heldout_examples if e.response_ids and len(e.prompt_ids) < limit]   # a response token left
        if not scored:
            raise ValueError("text evaluation: no held-out teacher answer has a response token to score")
        with torch.inference_mode():
            source = TeacherLogits(teacher_model, examples=scored, processor=tokenizer, max_seq_len=limit,
                                   device=teacher_model.device, what="eval: the teacher's logits")
        answers = [_Sequence(list(e.prompt_ids + e.response_ids)[:limit], len(e.prompt_ids) - 1, source[i].cpu())
                   for i, e in enumerate(scored)]
        return cls(answers, windows, str(teacher_model.dtype).removeprefix("torch."))

    def score(self, logits_fn: LogitsFn) -> dict:
        """``{"kl", "top1_agreement", "perplexity"}``: KL(teacher || model) per response token and the share of
        response positions where the model's most likely token is the teacher's (ties to the lowest id, as
        ``argmax``), over the held-out answers; perplexity ``exp(mean NLL)`` over every predicted corpus token."""
        kl = agree = tokens = 0.0
        for seq in self.answers:
            student = logits_fn(seq.ids)[seq.start:len(seq.ids) - 1].float()
            teacher = seq.teacher.float()
            kl += kl_sum(student, teacher).item()
            agree += (student.argmax(-1) == teacher.argmax(-1)).sum().item()
            tokens += student.shape[0]
        nll, predicted = window_nll(logits_fn, self.windows)
        return {"kl": kl / tokens, "top1_agreement": agree / tokens,
                "perplexity": math.exp(nll / predicted) if predicted else float("nan"),
                "kl_tokens": int(tokens), "perplexity_tokens": int(predicted)}


def window_nll(logits_fn: LogitsFn, windows: list[list[int]]) -> tuple[float, int]:
    """``(summed negative log-likelihood, predicted tokens)`` of a model on text windows: every position that predicts
    a token; the perplexity is ``exp(nll / tokens)``."""
    nll, predicted = 0.0, 0
    for ids in windows:
        logp = torch.log_softmax(logits_fn(ids)[:-1].float(), -1)
        nll -= logp.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
        predicted += len(ids) - 1
    return nll, predicted


def compare_on_windows(teacher: LogitsFn, student: LogitsFn, windows: list[list[int]]) -> dict:
    """``{"kl", "perplexity", "teacher_perplexity", "tokens"}`` of ``student`` against ``teacher`` on text windows:
    KL(teacher || student) per predicted token and both perplexities, over every position that predicts a token."""
    kl = nll_s = nll_t = 0.0
    n = 0
    for ids in windows:
        target = torch.tensor(ids[1:])[:, None]
        t_logits, s_logits = teacher(ids)[:-1].float(), student(ids)[:-1].float()
        kl += kl_sum(s_logits, t_logits).item()
        t_logp, s_logp = torch.log_softmax(t_logits, -1), torch.log_softmax(s_logits, -1)
        nll_t -= t_logp.gather(1, target).sum().item()
        nll_s -= s_logp.gather(1, target).sum().item()
        n += len(ids) - 1
    return {"kl": kl / n, "perplexity": math.exp(nll_s / n), "teacher_perplexity": math.exp(nll_t / n), "tokens": n}
