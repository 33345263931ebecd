"""``pipeline.bench.perplexity``: our packed models (and, with ``llama_cpp`` installed, a GGUF) beside the teacher on
a text file of the user's choice."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("gguf")

from pipeline.bench import perplexity  # noqa: E402
from tests.test_real_model import _teacher_model, bf16_gguf, rotated_teacher, teacher  # noqa: E402,F401  (fixtures)


def _pack(teacher_dir, model, root):
    from pipeline import formats
    from pipeline.packed.checkpoint import CheckpointReader
    from pipeline.cast.fit import fit_model
    from pipeline.packed.file import write_packed

    fmt = formats.get("s3d8")
    states, _ = fit_model(fmt, str(teacher_dir))
    path = root / "s3d8" / "direct-cast" / "model.safetensors"
    path.parent.mkdir(parents=True)
    write_packed(path, CheckpointReader(teacher_dir), fmt, states, metadata={"config": model.config.to_dict()})
    return path


def test_packed_and_gguf_rows_against_the_teacher_on_a_text(teacher, bf16_gguf, tmp_path):  # noqa: F811
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.texts import text_windows

    model, _, teacher_dir = teacher
    _pack(teacher_dir, model, tmp_path / "packed")
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat and the dog ran to the cat " * 8, encoding="utf-8")
    ggufs = [str(bf16_gguf)] if _has_llama_cpp() else []
    argv = ["--text", str(text), "--teacher", str(teacher_dir), "--packed", str(tmp_path / "packed"),
            "--tokens", "40", "--window", "16", "--threads", "1", "--out", str(tmp_path / "out")]
    for g in ggufs:
        argv += ["--gguf", g]
    assert perplexity.main(argv) == 0
    res = json.loads((tmp_path / "out.json").read_text())
    # the teacher's perplexity, computed here on the same windows
    tok = AutoTokenizer.from_pretrained(str(teacher_dir))
    windows = text_windows(text.read_text(), tok, 3, 16, "test")
    hf = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype=torch.bfloat16).eval()
    nll = n = 0
    with torch.no_grad():
        for ids in windows:
            logp = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
            nll -= logp.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
            n += len(ids) - 1
    assert res["text"]["windows"] == len(windows) == 3 and res["text"]["predicted_tokens"] == n
    assert res["teacher"]["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-5)
    ours = res["rows"][0]
    assert ours["name"] == "ours s3d8 direct-cast" and math.isfinite(ours["perplexity"]) and ours["x_teacher"] != 1
    if ggufs:                                   # the bf16 GGUF is the teacher: the same perplexity
        assert res["rows"][1]["x_teacher"] == pytest.approx(1, abs=0.02)
    md = (tmp_path / "out.md").read_text()
    assert "| ours s3d8 direct-cast |" in md and str(text) in md


def test_the_teacher_at_its_own_dtype(rotated_teacher, tmp_path):  # noqa: F811
    """A rotated teacher is float32 (in bf16 another model): its perplexity is the float32 model's, and says so."""
    from transformers import AutoTokenizer

    from pipeline.eval.text import hf_logits_fn, window_nll
    from pipeline.texts import text_windows

    text = tmp_path / "text.txt"
    text.write_text("a bird in the hand is worth two in the bush " * 8, encoding="utf-8")
    assert perplexity.main(["--text", str(text), "--teacher", str(rotated_teacher), "--packed", "", "--tokens", "48",
                            "--window", "16", "--threads", "1", "--out", str(tmp_path / "out")]) == 0
    res = json.loads((tmp_path / "out.json").read_text())["teacher"]
    windows = text_windows(text.read_text(), AutoTokenizer.from_pretrained(str(rotated_teacher)), 3, 16, "test")
    with torch.no_grad():
        nll, n = window_nll(hf_logits_fn(_teacher_model(rotated_teacher)), windows)
    assert res["dtype"] == "float32" and res["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-9)
    assert ", float32) perplexity" in (tmp_path / "out.md").read_text()


def test_a_text_that_is_not_utf8_is_named(teacher, tmp_path):  # noqa: F811
    _, _, teacher_dir = teacher
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 ".encode("latin-1") * 20)
    with pytest.raises(ValueError, match=r"--text: .*latin1\.txt: not UTF-8"):
        perplexity.main(["--text", str(bad), "--teacher", str(teacher_dir), "--packed", "", "--out",
                         str(tmp_path / "o")])
    with pytest.raises(SystemExit):
        perplexity.main(["--text", str(bad), "--gguf", str(tmp_path / "none*.gguf"), "--out", str(tmp_path / "o")])


def _has_llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True
