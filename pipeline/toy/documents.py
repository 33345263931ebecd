"""toy-docvqa (mirrors DocVQA): small rendered documents, a bold underlined title and one or two lines of
one word (an animal, then a thing), always at the same places; "what is written ..." questions; ANLS."""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image

from pipeline.toy import draw
from pipeline.toy.facts import Facts, join_words, plural

TITLES = ("Memo", "Report", "Letter", "Invoice", "Notice", "Menu", "Receipt", "Order")
# Each line draws from its own words, so that knowing which line is asked narrows the answer.
LINE_WORDS = (
    ("cat", "dog", "fish", "bird", "cow", "fox", "owl", "bee"),
    ("cup", "hat", "pen", "key", "box", "map", "lamp", "book"),
)
ORDINALS = ("first", "second")


@dataclass(frozen=True)
class Scene:
    title: str
    lines: tuple[str, str]  # an animal, then a thing

    @property
    def key(self) -> str:
        return "doc:" + "|".join((self.title,) + self.lines)


def sample(rng: random.Random) -> Scene:
    return Scene(rng.choice(TITLES), tuple(rng.choice(words) for words in LINE_WORDS))


def render(scene: Scene) -> Image.Image:
    image, d = draw.canvas()
    x, y = 4, 3
    draw.text(d, x, y, scene.title, size=13, bold=True)
    d.line([(x, y + 16), (x + draw.text_width(scene.title, 13) + 1, y + 16)], fill=draw.INK, width=1)
    for i, word in enumerate(scene.lines):
        draw.text(d, x, y + 22 + 17 * i, word, size=13)
    return image


def question(scene: Scene, rng: random.Random) -> tuple[str, str, list[str]]:
    """(question, canonical answer, reference answers)."""
    kind = rng.choice(["title", "line", "line"])
    if kind == "title":
        q = rng.choice(["What is the title of the document?", "What is written in the title?", "What is the heading?"])
        return q, scene.title, [scene.title, scene.title.lower()]
    i = rng.randrange(len(scene.lines))
    q = rng.choice([f"What is written on the {ORDINALS[i]} line?", f"What is the {ORDINALS[i]} word below the title?"]
                   + (["What is written on the last line?", "What is the last word of the document?"] if i == 1 else []))
    return q, scene.lines[i], [scene.lines[i]]


def facts(scene: Scene, colors: bool = True) -> Facts:
    quoted = [f'"{w}"' for w in scene.lines]
    n = len(scene.lines)
    return Facts(
        caption=f"a document titled {scene.title}",
        summary=f"The image shows a document titled {scene.title} with the {'word' if n == 1 else 'words'} {join_words(quoted)}.",
        details=[
            f"The title {scene.title} is written in bold and underlined.",
            f"Below the title there {'is' if n == 1 else 'are'} {plural(n, 'line')} of text: {join_words(quoted)}.",
        ]
        + (["The text is black on a white page."] if colors else []),
        items=[f'the title "{scene.title}"'] + [f'the word "{w}"' for w in scene.lines],
        colors=["black", "white"] if colors else [],
        layout=f"The title {scene.title} is at the top and {join_words(quoted)} {'is' if n == 1 else 'are'} written below it.",
        highlight=f"The title of the document is {scene.title}.",
        count=n + 1,
        noun="lines of text",
        words=[scene.title, *scene.lines],
    )
