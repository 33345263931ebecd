"""Answer extraction: from a model's free-text response to the string or option a metric scores."""

from __future__ import annotations

import re
from collections.abc import Sequence


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


short_answer = final_answer
"""Short-answer tasks (VQA, DocVQA) take the same extraction: the final-answer line if present, else the first
line."""

_LETTER_RE = re.compile(r"^\(?([A-Z])(?:[\).:]|\s|$)")
_EMBEDDED_LETTER_RE = re.compile(r"(?:answer|option|choice)(?:\s+is)?\s*:?\s*\(?([A-Z])\b", re.IGNORECASE)


def choice_index(response: str, options: Sequence[str]) -> int | None:
    """The option a response picks, as a 0-based index, or None.

    Tried in order: a leading option letter ("B", "(B)", "B. cat", after a "FINAL ANSWER:" too); the exact
    text of one option; a bare option number 1..n; "the answer is B"; a single option's text inside the
    response."""
    n = len(options)
    answer = final_answer(response)
    m = _LETTER_RE.match(answer)
    if m and ord(m.group(1)) - ord("A") < n:
        return ord(m.group(1)) - ord("A")
    lowered = [o.strip().lower() for o in options]
    if answer.lower() in lowered:
        return lowered.index(answer.lower())
    if answer.isdigit() and 1 <= int(answer) <= n:
        return int(answer) - 1
    m = _EMBEDDED_LETTER_RE.search(response)
    if m and ord(m.group(1).upper()) - ord("A") < n:
        return ord(m.group(1).upper()) - ord("A")
    text = response.lower()
    found = [i for i, o in enumerate(lowered) if o and re.search(rf"\b{re.escape(o)}\b", text)]
    if len(found) == 1:
        return found[0]
    return None
