"""The text evaluation of a text-only teacher (Llama, e.g. SmolLM2): KL to the teacher and top-1 agreement on
held-out teacher answers, and perplexity on real human-written English that every machine has.

The perplexity corpus is the prose of the Python Language Reference as CPython ships it in its standard library
(``pydoc_data.topics``: the text ``help()`` shows): written by people, in English, about 460 KB, present wherever
Python runs, with no download and a licence (PSF) that allows it. Indented blocks (code and grammar) and heading
underlines are dropped, so what remains is paragraphs of prose. The topics are split by name into a held-out
slice (every second topic in sorted order) and the rest; perplexity is measured on held-out windows only. The text
depends on the Python version: :func:`corpus_info` records the version and the hash of the text measured.

One code path scores every model, ours or llama.cpp's: a model is a ``logits_fn(ids) -> [len(ids), vocab]``
float32 tensor of the logits at every position of one sequence (no batching, no padding), and
:class:`TextReference` holds the teacher's side, computed once.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from pipeline.divergence import kl_sum

CORPUS = "python-language-reference-prose"
HELDOUT_EVERY = 2          # topics i with i % HELDOUT_EVERY == HELDOUT_EVERY - 1 (sorted names) are held out

LogitsFn = Callable[[list[int]], torch.Tensor]


def _prose(text: str) -> list[str]:
    """The prose paragraphs of one topic: blocks separated by blank lines, without indented (code, grammar)
    blocks and heading underlines, each joined into one line."""
    out = []
    for block in text.split("\n\n"):
        lines = [line for line in block.strip("\n").split("\n") if line.strip()]
        if not lines or lines[0].startswith((" ", "\t")):
            continue
        lines = [line for line in lines if set(line.strip()) - set("*=-^~")]    # drop heading underlines
        if len(lines) > 1 or (lines and len(lines[0].split()) > 6):            # headings alone are not prose
            out.append(" ".join(line.strip() for line in lines))
    return out


@lru_cache(maxsize=2)
def corpus_text(split: str = "heldout") -> str:
    """The corpus' prose, paragraphs separated by newlines: ``split`` "heldout" (what perplexity measures) or
    "rest"."""
    if split not in ("heldout", "rest"):
        raise ValueError(f"corpus split {split!r}: expected 'heldout' or 'rest'")
    from pydoc_data.topics import topics

    names = sorted(topics)
    chosen = [n for i, n in enumerate(names) if (i % HELDOUT_EVERY == HELDOUT_EVERY - 1) == (split == "heldout")]
    return "\n".join(p for n in chosen for p in _prose(topics[n]))


def corpus_info(split: str = "heldout") -> dict:
    text = corpus_text(split)
    return {"name": CORPUS, "source": "pydoc_data.topics (CPython standard library)",
            "python": ".".join(map(str, sys.version_info[:3])), "split": split,
            "heldout_rule": f"topics sorted by name; index % {HELDOUT_EVERY} == {HELDOUT_EVERY - 1} held out",
            "chars": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest()}


def corpus_windows(tokenizer, n_tokens: int, window: int) -> list[list[int]]:
    """The first ``n_tokens`` tokens of the held-out prose cut into windows of at most ``window`` tokens, each
    starting with what the tokenizer itself puts before a text (its BOS, for a tokenizer that adds one)."""
    if n_tokens < 2 or window < 2:
        raise ValueError(f"perplexity corpus: n_tokens={n_tokens} and window={window} must be >= 2")
    ids = tokenizer(corpus_text("heldout"), add_special_tokens=False)["input_ids"]
    if len(ids) < n_tokens:
        raise ValueError(f"perplexity corpus {CORPUS}: {len(ids)} held-out tokens, fewer than n_tokens={n_tokens}")
    ids = ids[:n_tokens]
    bos = tokenizer("")["input_ids"]
    step = window - len(bos)
    return [bos + ids[i:i + step] for i in range(0, len(ids), step)]


def text_windows(text: str, tokenizer, n: int, length: int, what: str) -> list[list[int]]:
    """The first ``n`` windows of ``length`` tokens of ``text``, each starting with what the tokenizer puts before a
    text (its BOS, for a tokenizer that adds one); fewer when the text is shorter (at least one, else an error)."""
    bos = tokenizer("")["input_ids"]
    step = length - len(bos)
    if step < 1:
        raise ValueError(f"calibrate.max_seq_len={length}: too short for a window")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    windows = [bos + ids[i:i + step] for i in range(0, min(len(ids), n * step), step)]
    windows = [w for w in windows if len(w) > len(bos) + 1]
    if not windows:
        raise ValueError(f"{what}: no text to calibrate on")
    return windows


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
        """``heldout_examples``: :class:`pipeline.answers.Example` (prompt ids, then the teacher's answer ids);
        each sequence is cut to ``max_seq_len`` tokens when given. ``tokenizer`` is unused for now but names the
        vocabulary the ids come from."""
        del tokenizer
        answers = []
        with torch.inference_mode():
            for e in heldout_examples:
                ids = list(e.prompt_ids + e.response_ids)[:max_seq_len]
                start = len(e.prompt_ids) - 1
                if start >= len(ids) - 1:
                    continue                         # no response token left to score
                out = teacher_model(input_ids=torch.tensor([ids], device=teacher_model.device)).logits[0]
                answers.append(_Sequence(ids, start, out[start:len(ids) - 1].cpu()))
        if not answers:
            raise ValueError("text evaluation: no held-out teacher answer has a response token to score")
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
