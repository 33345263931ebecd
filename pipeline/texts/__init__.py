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

And the prose of the Python Language Reference as CPython ships it in its standard library (``pydoc_data.topics``:
the text ``help()`` shows): written by people, in English, about 460 KB, present wherever Python runs, with no
download and a licence (PSF) that allows it. Indented blocks (code and grammar) and heading underlines are dropped,
so what remains is paragraphs of prose. The topics are split by name into a held-out slice (every second topic in
sorted order: the text evaluation's perplexity, :mod:`pipeline.eval.text`) and the rest (calibration and QAT's
``corpus``). The text depends on the Python version: :func:`corpus_info` records the version and the hash of the
text read. :func:`source_text` reads a text source by name (``corpus``, ``english``, ``file:PATH``).
"""

from __future__ import annotations

import hashlib
import sys
from functools import lru_cache
from pathlib import Path

from pipeline.files.hashes import file_hash

HERE = Path(__file__).resolve().parent
TEXTS = {"english": "english.txt", "english-heldout": "english_heldout.txt"}


def path(name: str) -> Path:
    """The file of a shipped text by its name (:data:`TEXTS`)."""
    if name not in TEXTS:
        raise ValueError(f"text {name!r}: the shipped texts are {', '.join(TEXTS)}")
    return HERE / TEXTS[name]


def read(name: str) -> str:
    return path(name).read_text(encoding="utf-8")


# --- the Python documentation's prose: the perplexity corpus (its held-out half) and a calibration text (the rest)

CORPUS = "python-language-reference-prose"
HELDOUT_EVERY = 2          # topics i with i % HELDOUT_EVERY == HELDOUT_EVERY - 1 (sorted names) are held out


def _prose(text: str) -> list[str]:
    """The prose paragraphs of one topic: blocks separated by blank lines, without indented (code, grammar)
    blocks and heading underlines, each joined into one line."""
    out = []
    for block in text.split("\n\n"):
        lines = [line for line in block.strip("\n").split("\n") if line.strip()]
        if not lines or lines[0].startswith((" ", "\t")):
            continue
        lines = [line for line in lines if set(line.strip()) - set("*=-^~")]    # drop heading underlines
        if len(lines) > 1 or (lines and len(lines[0].split()) > 6):            # headings alone are not prose
            out.append(" ".join(line.strip() for line in lines))
    return out


@lru_cache(maxsize=2)
def corpus_text(split: str = "heldout") -> str:
    """The corpus' prose, paragraphs separated by newlines: ``split`` "heldout" (what perplexity measures) or
    "rest"."""
    if split not in ("heldout", "rest"):
        raise ValueError(f"corpus split {split!r}: expected 'heldout' or 'rest'")
    from pydoc_data.topics import topics

    names = sorted(topics)
    chosen = [n for i, n in enumerate(names) if (i % HELDOUT_EVERY == HELDOUT_EVERY - 1) == (split == "heldout")]
    return "\n".join(p for n in chosen for p in _prose(topics[n]))


def corpus_info(split: str = "heldout") -> dict:
    text = corpus_text(split)
    return {"name": CORPUS, "source": "pydoc_data.topics (CPython standard library)",
            "python": ".".join(map(str, sys.version_info[:3])), "split": split,
            "heldout_rule": f"topics sorted by name; index % {HELDOUT_EVERY} == {HELDOUT_EVERY - 1} held out",
            "chars": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest()}


def corpus_windows(tokenizer, n_tokens: int, window: int) -> list[list[int]]:
    """The first ``n_tokens`` tokens of the held-out prose cut into windows of at most ``window`` tokens, each
    starting with what the tokenizer itself puts before a text (its BOS, for a tokenizer that adds one)."""
    if n_tokens < 2 or window < 2:
        raise ValueError(f"perplexity corpus: n_tokens={n_tokens} and window={window} must be >= 2")
    ids = tokenizer(corpus_text("heldout"), add_special_tokens=False)["input_ids"]
    if len(ids) < n_tokens:
        raise ValueError(f"perplexity corpus {CORPUS}: {len(ids)} held-out tokens, fewer than n_tokens={n_tokens}")
    ids = ids[:n_tokens]
    bos = tokenizer("")["input_ids"]
    step = window - len(bos)
    return [bos + ids[i:i + step] for i in range(0, len(ids), step)]


def text_windows(text: str, tokenizer, n: int, length: int, what: str) -> list[list[int]]:
    """The first ``n`` windows of ``length`` tokens of ``text``, each starting with what the tokenizer puts before a
    text (its BOS, for a tokenizer that adds one); fewer when the text is shorter (at least one, else an error)."""
    bos = tokenizer("")["input_ids"]
    step = length - len(bos)
    if step < 1:
        raise ValueError(f"calibrate.max_seq_len={length}: too short for a window")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    windows = [bos + ids[i:i + step] for i in range(0, min(len(ids), n * step), step)]
    windows = [w for w in windows if len(w) > len(bos) + 1]
    if not windows:
        raise ValueError(f"{what}: no text to calibrate on")
    return windows


# --- a text source by name (calibrate.source, qat.corpus_source)

def source_text(source: str, param: str) -> tuple[str, str]:
    """``(text, what it is)`` of one text source: ``corpus`` (the prose corpus' calibration half), ``english`` (the
    shipped English) or ``file:PATH``; ``param`` names the parameter in errors."""
    if source == "corpus":
        return corpus_text("rest"), f"calibration corpus {CORPUS}"
    if source == "english":
        return read("english"), "the shipped English text (pipeline/texts/english.txt)"
    if not source.startswith("file:"):
        raise ValueError(f"{param}: {source!r} is not corpus, english or file:PATH")
    file = Path(source.removeprefix("file:"))
    return read_file(file, param), str(file)


def read_file(file: str | Path, what: str) -> str:
    """A user's UTF-8 text file; a ValueError naming ``what`` (the flag or parameter) and the file otherwise."""
    file = Path(file)
    if not file.is_file():
        raise ValueError(f"{what}: {file}: no such file")
    try:
        return file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what}: {file}: not UTF-8 text ({e})") from None


def source_hash(source: str) -> str:
    """The content hash of one text source of :func:`source_text` (what a fingerprint records)."""
    if source == "corpus":
        return corpus_info("rest")["sha256"]
    return file_hash(path("english") if source == "english" else source.removeprefix("file:"))
