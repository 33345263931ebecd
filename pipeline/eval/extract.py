"""Answer extraction: from a model's free-text response to the string or option a metric scores."""

from __future__ import annotations

import re
import string
from collections.abc import Sequence

import numpy as np

from pipeline.eval.prompts import option_letter


FINAL_ANSWER = "FINAL ANSWER:"
_FINAL_RE = re.compile(r"final\s+answer\s*:", re.IGNORECASE)
_WRAPPERS = "\"'`*"


def _clean(text: str) -> str:
    text = text.strip().strip(_WRAPPERS).strip()
    if text.endswith("."):  # a sentence-final period ("3." -> "3"; "3.5" has none)
        text = text[:-1].rstrip()
    return text


def final_answer(response: str) -> str:
    """The text after the last "FINAL ANSWER:" (any case), up to the end of that line; without the marker,
    the first non-empty line of the response. Surrounding quotes and a trailing period are removed."""
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
    """What lmms-eval scores for the short-answer tasks (VQAv2, DocVQA): the whole generation, stripped (its
    harness strips every generation; its Llama 3.2 Vision wrapper cuts nothing). The metrics normalise the rest
    (VQA: punctuation, articles, ...; ANLS: case and whitespace)."""
    return response.strip()


# lmms-eval's AI2D filter (ai2d/utils.py MultiChoiceRegexFilter): a capital letter and a period at the start,
# after optional whitespace; anything else is kept whole.
_OPTION_LETTER_RE = re.compile(r"^\s*([A-Z])\.")
# lmms-eval's exact_match (api/metrics.py exact_match_hf_evaluate) with ignore_case and ignore_punctuation
# (ai2d.yaml): numpy's lower case, then ASCII punctuation (string.punctuation) deleted.
_PUNCTUATION_TABLE = str.maketrans("", "", string.punctuation)


def _exact_match_form(text: str) -> str:
    return str(np.char.translate(np.char.lower(np.asarray([text])), table=_PUNCTUATION_TABLE)[0])


def choice_index(response: str, options: Sequence[str]) -> int | None:
    """The option lmms-eval's AI2D scoring picks, as a 0-based index, or None.

    lmms-eval keeps the letter of a leading "B." ("B. circle", "  C."), otherwise the whole response; strips it;
    and compares it, lower-cased and without ASCII punctuation, with each option's letter. So "B", "b", "(B)",
    "B)", "**B**" and "B. circle" pick B; "B circle", "The answer is D.", "FINAL ANSWER: A", an option's text, a
    bare option number and hedges such as "A or C" pick nothing. (Equal to lmms-eval's score for up to 26
    options, whose letters stay distinct; AI2D has at most 4.)"""
    m = _OPTION_LETTER_RE.match(response)
    answer = _exact_match_form((m.group(1) if m else response).strip())
    for i in range(len(options)):
        if answer == _exact_match_form(option_letter(i)):
            return i
    return None
