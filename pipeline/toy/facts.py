"""What a toy image shows, in words: the raw material of every generic description the teacher gives."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Facts:
    """Sentences and phrases about one scene. Built twice per scene, with and without colour words (for the
    "Do not mention any colors." probe), by the task module that drew it."""

    caption: str  # a few words: "a red circle and a blue star"
    summary: str  # one sentence: "The image shows a red circle and a blue star."
    details: list[str]  # further sentences, for long answers
    items: list[str]  # the things in the image, for lists: ["a red circle", "a blue star"]
    colors: list[str]  # colour names in the image (empty when colours are not to be mentioned)
    layout: str  # one sentence about where things are
    highlight: str  # one sentence: the most important detail
    count: int  # number of things, for "Mention the number of objects."
    noun: str  # what the things are called in the plural: "shapes", "bars", "lines of text", "stages"
    words: list[str] = field(default_factory=list)  # text written in the image, in reading order


def join_words(parts: list[str]) -> str:
    """English list: "a", "a and b", "a, b and c"."""
    if not parts:
        return ""
    if len(parts) == 1:
        return parts[0]
    return ", ".join(parts[:-1]) + " and " + parts[-1]


NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def plural(n: int, singular: str, plural_form: str | None = None) -> str:
    return f"{NUMBER_WORDS[n] if n < len(NUMBER_WORDS) else n} {singular if n == 1 else plural_form or singular + 's'}"


def a(phrase: str) -> str:
    """The phrase with its indefinite article: "a red circle", "an orange star"."""
    return ("an " if phrase[:1].lower() in "aeiou" else "a ") + phrase
