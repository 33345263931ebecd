"""toy-ai2d (mirrors AI2D): flow diagrams of three coloured shapes joined by arrows, left to right;
multiple-choice questions on where the flow starts and ends and on the missing shape, with the four shape
names as options; accuracy."""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image

from pipeline.toy import draw
from pipeline.toy.facts import Facts, a, join_words

XS = (9, 32, 55)  # stage centres, left to right
SIZE = 13
Y = 30


@dataclass(frozen=True)
class Scene:
    shapes: tuple[str, str, str]  # left to right, the order of the arrows
    colors: tuple[str, str, str]

    @property
    def flow(self) -> tuple[str, ...]:
        """The stages in the order of the arrows."""
        return self.shapes

    @property
    def key(self) -> str:
        return "diagram:" + "-".join(f"{c} {s}" for c, s in zip(self.colors, self.shapes))


def sample(rng: random.Random) -> Scene:
    shapes = tuple(rng.sample(draw.SHAPES, 3))
    colors = tuple(rng.sample(sorted(draw.COLORS), 3))
    return Scene(shapes, colors)


def render(scene: Scene) -> Image.Image:
    image, d = draw.canvas()
    for x, s, c in zip(XS, scene.shapes, scene.colors):
        draw.shape(d, s, x, Y, SIZE, draw.COLORS[c])
    gap = SIZE / 2 + 1
    for left, right in zip(XS[:-1], XS[1:]):
        draw.arrow(d, left + gap, Y, right - gap, Y, head=5)
    return image


def question(scene: Scene, rng: random.Random) -> tuple[str, str, list[str]]:
    """(question, correct option text, options). The options are the four shape names, always in the same
    order: the answer is what the diagram shows, not where the option was listed."""
    flow = scene.flow
    kind = rng.choices(["first", "last", "missing"], weights=[0.35, 0.3, 0.35])[0]
    if kind == "first":
        q, answer = rng.choice(["Which stage comes first in the diagram?", "Where does the flow start?"]), flow[0]
    elif kind == "last":
        q, answer = rng.choice(["Which stage comes last in the diagram?", "Where does the flow end?"]), flow[-1]
    else:
        q, answer = "Which shape is not in the diagram?", next(s for s in draw.SHAPES if s not in flow)
    return q, answer, list(draw.SHAPES)


def facts(scene: Scene, colors: bool = True) -> Facts:
    by_shape = dict(zip(scene.shapes, scene.colors))

    def name(s: str) -> str:
        return a(f"{by_shape[s]} {s}") if colors else a(s)

    flow = scene.flow
    direction = "from left to right"
    return Facts(
        caption="a diagram of three stages",
        summary=f"The image shows a diagram where {name(flow[0])} leads to {name(flow[1])} and then to {name(flow[2])}.",
        details=[
            f"The {flow[0]} is the first stage and the {flow[2]} is the last stage.",
            f"The arrows point {direction}.",
        ]
        + ([f"The colors are {join_words([by_shape[s] for s in flow])}."] if colors else []),
        items=[name(s) for s in flow],
        colors=[by_shape[s] for s in flow] if colors else [],
        layout=f"Three shapes stand in a row, joined by arrows. The {scene.shapes[0]} is on the left and the {scene.shapes[2]} is on the right.",
        highlight=f"The flow starts at the {flow[0]} and ends at the {flow[2]}.",
        count=3,
        noun="stages",
        words=[],
    )
