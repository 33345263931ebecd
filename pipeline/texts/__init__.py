"""English texts the project ships, so that calibration and an independent check need no download and are the same
on every machine (their sources and licences: ``README.md`` beside this file; ``python -m pipeline.texts.build``
rebuilds them):

- ``english``: public-domain English of three kinds, interleaved a paragraph or a few at a time so that every window
  mixes them: Lewis Carroll's *Alice's Adventures in Wonderland* (fiction), the Library of Congress *Workshop on
  Electronic Texts: Proceedings* (1992; talks and discussion) and the 1911 Encyclopaedia Britannica article
  *Shakespeare* (encyclopedic). A calibration text (``calibrate.source: english``, ``s3d8 pack``'s default beside
  the Python documentation's prose).
- ``english-heldout``: the opening of Natsume Soseki's *Botchan* in Yasotaro Morri's English translation (fiction);
  nothing is calibrated or trained on it: an independent text to measure perplexity on
  (``python -m pipeline.bench.perplexity --text english-heldout``).
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
TEXTS = {"english": "english.txt", "english-heldout": "english_heldout.txt"}


def path(name: str) -> Path:
    """The file of a shipped text by its name (:data:`TEXTS`)."""
    if name not in TEXTS:
        raise ValueError(f"text {name!r}: the shipped texts are {', '.join(TEXTS)}")
    return HERE / TEXTS[name]


def read(name: str) -> str:
    return path(name).read_text(encoding="utf-8")
