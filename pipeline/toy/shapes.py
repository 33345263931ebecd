"""toy-vqa (mirrors VQAv2): scenes of 1-4 coloured shapes in a 2 x 2 grid; colour, shape, count and yes/no
questions, each with ten annotators' answers so that VQA accuracy applies.

Shapes sit at the centres of their cells, at one size: a 5 M-parameter model trained for half an hour learns
to tell shapes apart at a few fixed places, not yet anywhere in the picture."""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image

from pipeline.toy import draw
from pipeline.toy.facts import NUMBER_WORDS, Facts, a, join_words, plural

CELLS = ("top left", "top right", "bottom left", "bottom right")


SIZE = 22


@dataclass(frozen=True)
class Thing:
    color: str
    shape: str
    cell: int  # index into CELLS


@dataclass(frozen=True)
class Scene:
    things: tuple[Thing, ...]  # distinct colours, distinct shapes, distinct cells

    @property
    def key(self) -> str:
        """Identity of the scene, for the train / held-out split."""
        return "shapes:" + ";".join(f"{t.color}-{t.shape}-{t.cell}" for t in sorted(self.things, key=lambda t: t.cell))


def sample(rng: random.Random) -> Scene:
    n = 1 if rng.random() < 0.4 else rng.randint(2, 4)
    colors = rng.sample(sorted(draw.COLORS), n)
    shapes = rng.sample(draw.SHAPES, n)
    cells = rng.sample(range(4), n)
    things = tuple(Thing(c, s, cell) for c, s, cell in zip(colors, shapes, cells))
    return Scene(tuple(sorted(things, key=lambda t: t.cell)))


def render(scene: Scene) -> Image.Image:
    image, d = draw.canvas()
    for t in scene.things:
        draw.shape(d, t.shape, 16 + 32 * (t.cell % 2), 16 + 32 * (t.cell // 2), SIZE, draw.COLORS[t.color])
    return image


# --- questions -------------------------------------------------------------------------------------------


def _annotators(rng: random.Random, variants: list[str], wrong: list[str], p_wrong: float = 0.08) -> list[str]:
    """Ten annotators: mostly the canonical answer, sometimes a variant the VQA normalisation maps onto it
    ("two", "Red", "a circle"), now and then a different answer."""
    refs = []
    for _ in range(10):
        if wrong and rng.random() < p_wrong:
            refs.append(rng.choice(wrong))
        elif rng.random() < 0.25:
            refs.append(rng.choice(variants))
        else:
            refs.append(variants[0])
    return refs


def _yes_no(rng: random.Random, answer: str) -> list[str]:
    other = "no" if answer == "yes" else "yes"
    return _annotators(rng, [answer, answer.capitalize(), f"{answer}."], [other], p_wrong=0.05)


def question(scene: Scene, rng: random.Random) -> tuple[str, str, list[str]]:
    """(question, canonical answer, ten reference answers).

    Colour and shape questions name the object when there is one; with several, "What color is the circle?"
    (finding the object first) is asked less often than questions about the whole picture (counts, whether a
    colour or shape is present)."""
    colors, shapes = sorted(draw.COLORS), list(draw.SHAPES)
    single = len(scene.things) == 1
    if single:
        kind = rng.choices(["color", "shape", "count", "has_color"], weights=[0.35, 0.3, 0.1, 0.25])[0]
    else:
        kind = rng.choices(["count", "has_color", "has_shape", "color"], weights=[0.35, 0.3, 0.15, 0.2])[0]
    if kind == "color":
        t = rng.choice(scene.things)
        q = rng.choice([f"What color is the {t.shape}?", f"What is the color of the {t.shape}?"])
        if single:
            q = rng.choice([q, "What color is the shape?"])
        others = [c for c in colors if c != t.color]
        return q, t.color, _annotators(rng, [t.color, t.color.capitalize(), f"{t.color}."], others)
    if kind == "shape":
        t = scene.things[0]
        q = rng.choice(["What shape is shown?", "What shape is it?", f"What shape is the {t.color} object?"])
        others = [s for s in shapes if s != t.shape]
        return q, t.shape, _annotators(rng, [t.shape, f"a {t.shape}", t.shape.capitalize()], others)
    if kind == "count":
        n = len(scene.things)
        q = rng.choice(["How many shapes are there?", "How many shapes are in the image?"])
        others = [str(k) for k in (n - 1, n + 1) if k >= 1]
        return q, str(n), _annotators(rng, [str(n), NUMBER_WORDS[n]], others)
    if kind == "has_color":  # yes / no, half and half
        present = {t.color for t in scene.things}
        color = rng.choice(sorted(present) if rng.random() < 0.5 else [c for c in colors if c not in present])
        answer = "yes" if color in present else "no"
        return f"Is there {a(color)} shape?", answer, _yes_no(rng, answer)
    present = {t.shape for t in scene.things}
    absent = [s for s in shapes if s not in present]
    shape = rng.choice(sorted(present) if rng.random() < 0.5 or not absent else absent)
    answer = "yes" if shape in present else "no"
    return f"Is there {a(shape)}?", answer, _yes_no(rng, answer)


# --- description -----------------------------------------------------------------------------------------


def facts(scene: Scene, colors: bool = True) -> Facts:
    def name(t: Thing) -> str:
        return a(f"{t.color} {t.shape}") if colors else a(t.shape)

    items = [name(t) for t in scene.things]
    n = len(scene.things)
    where = [f"{name(t)} at the {CELLS[t.cell]}" for t in scene.things]
    layout = (
        f"There is {where[0]}." if n == 1 else f"There is {join_words(where)}."
    )
    background = "a white" if colors else "a plain"
    details = [f"There {'is' if n == 1 else 'are'} {plural(n, 'shape')} on {background} background.", layout]
    if colors:
        details.append(f"The colors are {join_words([t.color for t in scene.things])}.")
    first = scene.things[0]
    return Facts(
        caption=join_words(items),
        summary=f"The image shows {join_words(items)}.",
        details=details,
        items=items,
        colors=[t.color for t in scene.things] if colors else [],
        layout=layout,
        highlight=f"The shape at the {CELLS[first.cell]} is {name(first)}.",
        count=n,
        noun="shapes",
    )
