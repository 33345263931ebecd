"""The user prompt of each benchmark family, shared by the real benchmarks and their toy counterparts.

The wording follows lmms-eval's prompts for VQAv2, DocVQA and AI2D; ChartQA asks for the answer after
"FINAL ANSWER:", as SPEC section 6 requires.
"""

from __future__ import annotations

from collections.abc import Sequence


SHORT_ANSWER = "Answer the question using a single word or phrase."
CHART_ANSWER = "Answer with a single word or number in a line 'FINAL ANSWER: <answer>'."
OPTION_ANSWER = "Answer with the option's letter from the given choices directly."


def option_letter(index: int) -> str:
    """"A", "B", ... for option 0, 1, ..."""
    return chr(ord("A") + index)


def vqa_prompt(question: str) -> str:
    return f"{question.strip()}\n{SHORT_ANSWER}"


def chartqa_prompt(question: str) -> str:
    return f"{question.strip()}\n{CHART_ANSWER}"


def docvqa_prompt(question: str) -> str:
    return f"{question.strip()}\n{SHORT_ANSWER}"


def ai2d_prompt(question: str, options: Sequence[str]) -> str:
    listed = "\n".join(f"{option_letter(i)}. {o}" for i, o in enumerate(options))
    return f"{question.strip()}\n{listed}\n{OPTION_ANSWER}"


def prompt_for(family: str, question: str, options: Sequence[str] | None = None) -> str:
    if family == "vqa":
        return vqa_prompt(question)
    if family == "chartqa":
        return chartqa_prompt(question)
    if family == "docvqa":
        return docvqa_prompt(question)
    if family == "ai2d":
        if options is None:
            raise ValueError("ai2d prompt needs options")
        return ai2d_prompt(question, options)
    raise ValueError(f"unknown benchmark family {family!r}; known: vqa, chartqa, docvqa, ai2d")
