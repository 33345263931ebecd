"""toy-chartqa (mirrors ChartQA): bar charts of 3-4 coloured bars with values 1-9 on a gridded axis;
questions on the tallest / shortest bar, the highest / lowest value and a bar's value; relaxed accuracy.

Bar i stands in the i-th 16-pixel column of the picture, so each bar has a place of its own."""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image

from pipeline.toy import draw
from pipeline.toy.facts import Facts, a, join_words, plural

BASE_Y = 59  # the x axis
UNIT = 6  # pixels per unit of value: gridlines at every unit
COLUMN = 16  # each bar's column
BAR_LEFT, BAR_WIDTH = 3, 10  # a bar's place inside its column
GRID = (205, 205, 205)


@dataclass(frozen=True)
class Bar:
    color: str
    value: int


@dataclass(frozen=True)
class Scene:
    bars: tuple[Bar, ...]  # left to right; distinct colours and distinct values

    @property
    def key(self) -> str:
        return "chart:" + ";".join(f"{b.color}-{b.value}" for b in self.bars)


def sample(rng: random.Random) -> Scene:
    n = rng.choice([3, 4])
    colors = rng.sample(sorted(draw.COLORS), n)
    values = rng.sample(range(1, 10), n)
    return Scene(tuple(Bar(c, v) for c, v in zip(colors, values)))


def render(scene: Scene) -> Image.Image:
    image, d = draw.canvas()
    for v in range(1, 10):
        y = BASE_Y - v * UNIT
        d.line([(1, y), (63, y)], fill=GRID, width=1)
    for i, bar in enumerate(scene.bars):
        x0 = COLUMN * i + BAR_LEFT
        d.rectangle([x0, BASE_Y - bar.value * UNIT, x0 + BAR_WIDTH - 1, BASE_Y - 1], fill=draw.COLORS[bar.color])
    d.line([(0, 2), (0, BASE_Y)], fill=draw.INK, width=1)
    d.line([(0, BASE_Y), (63, BASE_Y)], fill=draw.INK, width=1)
    return image


def question(scene: Scene, rng: random.Random) -> tuple[str, str, list[str]]:
    """(question, canonical answer, reference labels). Mostly about the whole chart (the tallest or shortest
    bar, the highest or lowest value); sometimes about one bar found by its colour."""
    kind = rng.choices(["tallest", "highest", "shortest", "lowest", "value"], weights=[0.3, 0.3, 0.1, 0.1, 0.2])[0]
    top = max(scene.bars, key=lambda b: b.value)
    low = min(scene.bars, key=lambda b: b.value)
    if kind == "tallest":
        q = rng.choice(["Which bar is the tallest?", "Which color is the tallest bar?", "Which bar has the highest value?"])
        return q, top.color, [top.color]
    if kind == "highest":
        q = rng.choice(["What is the highest value in the chart?", "What is the value of the tallest bar?"])
        return q, str(top.value), [str(top.value)]
    if kind == "shortest":
        q = rng.choice(["Which bar is the shortest?", "Which color is the shortest bar?", "Which bar has the lowest value?"])
        return q, low.color, [low.color]
    if kind == "lowest":
        q = rng.choice(["What is the lowest value in the chart?", "What is the value of the shortest bar?"])
        return q, str(low.value), [str(low.value)]
    bar = rng.choice(scene.bars)
    q = rng.choice([f"What is the value of the {bar.color} bar?", f"How high is the {bar.color} bar?"])
    return q, str(bar.value), [str(bar.value)]


def facts(scene: Scene, colors: bool = True) -> Facts:
    n = len(scene.bars)
    names = [a(f"{b.color} bar") if colors else "a bar" for b in scene.bars]
    tallest = max(scene.bars, key=lambda b: b.value)
    shortest = min(scene.bars, key=lambda b: b.value)
    if colors:
        values = [f"the {b.color} bar is at {b.value}" for b in scene.bars]
        items = [a(f"{b.color} bar of {b.value}") for b in scene.bars]
        highlight = f"The {tallest.color} bar is the tallest, at {tallest.value}."
        details = [
            f"The values are: {join_words(values)}.",
            highlight,
            f"The {shortest.color} bar is the shortest, at {shortest.value}.",
        ]
    else:
        values = [str(b.value) for b in scene.bars]
        items = [f"a bar of {b.value}" for b in scene.bars]
        highlight = f"The tallest bar reaches {tallest.value}."
        details = [f"From left to right the values are {join_words(values)}.", highlight,
                   f"The shortest bar reaches {shortest.value}."]
    return Facts(
        caption=f"a bar chart with {plural(n, 'bar')}",
        summary=f"The image shows a bar chart with {plural(n, 'bar')}" + (f": {join_words(names)}." if colors else "."),
        details=details,
        items=items,
        colors=[b.color for b in scene.bars] if colors else [],
        layout=f"The chart has {plural(n, 'bar')} standing on a horizontal axis, with grid lines behind them.",
        highlight=highlight,
        count=n,
        noun="bars",
    )
