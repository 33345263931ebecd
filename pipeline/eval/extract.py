"""Answer extraction: from a model's free-text response to the string or option a metric scores.

Nothing here strips a response unless its docstring says so: lmms-eval's filters see the decoded text as is, and
its harness strips what they return (``generation``), as ``tasks.score`` does.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence

import numpy as np

from pipeline.eval.task_prompts import option_letter


FINAL_ANSWER = "FINAL ANSWER:"
_FINAL_RE = re.compile(r"final\s+answer\s*:", re.IGNORECASE)
_WRAPPERS = "\"'`*"


def _clean(text: str) -> str:
    text = text.strip(_WRAPPERS + string.whitespace).strip()  # '** "red"' -> 'red'
    if text.endswith("."):  # a sentence-final period ("3." -> "3"; "3.5" has none)
        text = text[:-1].rstrip()
    return text


def generation(response: str) -> str:
    """What lmms-eval's harness hands a task's scoring: the generation (after its filters) with surrounding
    whitespace stripped (``ConfigurableTask.process_results`` strips every ``generate_until`` result)."""
    return response.strip()


def final_answer_line(response: str) -> str:
    """The answer SPEC section 6 takes for ChartQA, as a regex filter ``final\\s+answer\\s*:\\s*(.*)`` would: the
    first line of text after the last "FINAL ANSWER:" (any case), trailing whitespace kept; without the marker,
    the whole response. Nothing else is removed (no quotes, no period): this is what ChartQA's score sees."""
    matches = list(_FINAL_RE.finditer(response))
    if not matches:
        return response
    return response[matches[-1].end():].lstrip().split("\n", 1)[0]


def final_answer(response: str) -> str:
    """The cleaned-up ChartQA answer (the ``cleaned`` score, reported beside lmms-eval's, never instead): the
    text after the last "FINAL ANSWER:" (any case), up to the end of that line; without the marker, the first
    non-empty line of the response. Surrounding whitespace, quotes and a trailing period are removed."""
    matches = list(_FINAL_RE.finditer(response))
    if matches:
        text = response[matches[-1].end():]
        line = text.strip().split("\n", 1)[0] if text.strip() else ""
        return _clean(line)
    for line in response.strip().split("\n"):
        if line.strip():
            return _clean(line)
    return ""


def short_answer(response: str) -> str:
    """What lmms-eval scores for the short-answer tasks (VQAv2, DocVQA): the whole generation, stripped by its
    harness (``generation``; its Llama 3.2 Vision wrapper passes the decoded text as is, no filter cuts it). The
    metrics normalise the rest (VQA: punctuation, articles, ...; ANLS: case and whitespace)."""
    return generation(response)


# lmms-eval's AI2D filter (ai2d/utils.py MultiChoiceRegexFilter): a capital letter and a period at the start,
# after optional whitespace; anything else is kept whole.
_OPTION_LETTER_RE = re.compile(r"^\s*([A-Z])\.")
# lmms-eval's exact_match (api/metrics.py exact_match_hf_evaluate) with ignore_case and ignore_punctuation
# (ai2d.yaml): numpy's lower case, then ASCII punctuation (string.punctuation) deleted.
_PUNCTUATION_TABLE = str.maketrans("", "", string.punctuation)


def _exact_match_form(text: str) -> str:
    return str(np.char.translate(np.char.lower(np.asarray([text])), table=_PUNCTUATION_TABLE)[0])


def ai2d_filter(response: str) -> str:
    """lmms-eval's AI2D filter (``MultiChoiceRegexFilter.apply``): the letter of a leading "B." ("B. circle",
    "  C."), otherwise the response as it is."""
    m = _OPTION_LETTER_RE.match(response)
    return m.group(1) if m else response


def choice_index(response: str, options: Sequence[str]) -> int | None:
    """The option lmms-eval's AI2D filter and exact match pick for ``response`` as given, as a 0-based index,
    or None.

    The filter keeps the letter of a leading "B." ("B. circle", "  C."), otherwise the whole response, which
    the exact match compares, lower-cased and without ASCII punctuation but with its whitespace, with each
    option's letter. So "B", "b", "(B)", "B)", "**B**" and "B. circle" pick B; "B circle", " B", "B\n", "The
    answer is D.", "FINAL ANSWER: A", an option's text, a bare option number and hedges such as "A or C" pick
    nothing. A model's generation goes through lmms-eval's harness first: ``tasks.score`` passes
    ``generation(ai2d_filter(response))``, so " B" and "B\n" pick B there. (Equal to lmms-eval's score for up to
    26 options, whose letters stay distinct; AI2D has at most 4.)"""
    answer = _exact_match_form(ai2d_filter(response))
    for i in range(len(options)):
        if answer == _exact_match_form(option_letter(i)):
            return i
    return None
