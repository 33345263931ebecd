"""PIL drawing primitives shared by the toy tasks: the palette, the shapes, arrows and text.

Everything is drawn without randomness; the callers pass in every position and size, so an image is a pure
function of its scene.
"""

from __future__ import annotations

import functools
import math

from PIL import Image, ImageDraw, ImageFont

IMAGE_SIZE = 64
BACKGROUND = (255, 255, 255)

# Well separated hues, so that a small vision model tells them apart at once.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 225),
    "yellow": (240, 200, 0),
    "purple": (140, 50, 190),
    "orange": (250, 130, 0),
}
SHAPES = ("circle", "square", "triangle", "star")
INK = (20, 20, 20)


def canvas(size: int = IMAGE_SIZE) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    image = Image.new("RGB", (size, size), BACKGROUND)
    return image, ImageDraw.Draw(image)


def shape(draw: ImageDraw.ImageDraw, kind: str, cx: float, cy: float, size: float, fill) -> None:
    """A filled shape of the given kind whose bounding box is ``size`` wide, centred on (cx, cy)."""
    r = size / 2
    if kind == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif kind == "square":
        s = r * 0.85
        draw.rectangle([cx - s, cy - s, cx + s, cy + s], fill=fill)
    elif kind == "triangle":
        draw.polygon([(cx, cy - r), (cx + r, cy + r * 0.8), (cx - r, cy + r * 0.8)], fill=fill)
    elif kind == "star":
        points = []
        for i in range(10):
            radius = r if i % 2 == 0 else r * 0.45
            angle = -math.pi / 2 + i * math.pi / 5
            points.append((cx + radius * math.cos(angle), cy + radius * math.sin(angle)))
        draw.polygon(points, fill=fill)
    else:
        raise ValueError(f"unknown shape {kind!r}; known: {SHAPES}")


def arrow(draw: ImageDraw.ImageDraw, x0: float, y0: float, x1: float, y1: float, head: float = 5, fill=INK) -> None:
    """A line from (x0, y0) to (x1, y1) with a filled head at (x1, y1)."""
    draw.line([(x0, y0), (x1, y1)], fill=fill, width=2)
    angle = math.atan2(y1 - y0, x1 - x0)
    left = (x1 - head * math.cos(angle - 0.5), y1 - head * math.sin(angle - 0.5))
    right = (x1 - head * math.cos(angle + 0.5), y1 - head * math.sin(angle + 0.5))
    draw.polygon([(x1, y1), left, right], fill=fill)


@functools.lru_cache(maxsize=8)
def font(size: int) -> ImageFont.FreeTypeFont:
    """Pillow's built-in scalable font: no system font files, so images are the same on every machine."""
    return ImageFont.load_default(size=size)


def text(draw: ImageDraw.ImageDraw, x: float, y: float, s: str, size: int, fill=INK, bold: bool = False) -> None:
    draw.text((x, y), s, font=font(size), fill=fill)
    if bold:
        draw.text((x + 1, y), s, font=font(size), fill=fill)


def text_width(s: str, size: int) -> float:
    return font(size).getlength(s)
