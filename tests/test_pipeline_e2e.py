"""The whole DAG with `dvc repro` on the CI-sized preset, in a scratch copy of the working tree.

Slow (minutes): run with `pytest -m slow`. CI runs it after the default suite.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _copy_tree(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)
    for built in REPO.glob("pipeline/_s3d8_native*.so"):      # the native library, built by setup.sh
        shutil.copy2(built, dst / "pipeline" / built.name)


def _run(cmd: list[str], cwd: Path, timeout: int = 1800) -> str:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(cwd)}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_dvc_repro_ci_preset(tmp_path):
    work = tmp_path / "repo"
    work.mkdir()
    _copy_tree(work)
    _run(["git", "init", "-q"], work)
    _run(["git", "-c", "user.email=ci@example.com", "-c", "user.name=ci", "commit", "-qm", "copy", "--allow-empty"], work)
    _run([str(BIN / "python"), "-m", "pipeline.params", "apply", "configs/ci.yaml"], work)
    started = time.perf_counter()
    log = _run([str(BIN / "dvc"), "repro"], work)
    minutes = (time.perf_counter() - started) / 60
    print(f"\nCI-sized dvc repro: {minutes:.1f} minutes")
    assert "Running stage 'toy-teacher'" not in log, "the committed teacher must not be retrained"

    result = json.loads((work / "reports/eval.json").read_text())
    formats = ["s3d8", "int", "student_t", "lloyd_max"]
    assert set(result["models"]) == {"bf16-teacher"} | {f"{f}-{m}" for f in formats for m in ("direct-cast", "qat")}
    for name, m in result["models"].items():
        assert m["avg"] == pytest.approx(sum(m["scores"].values()) / len(m["scores"]))
        if m["method"] != "teacher":
            pack = json.loads((work / f"reports/pack/{m['format']}.json").read_text())[m["method"]]
            assert m["bpp"] == pytest.approx(pack["bits_per_param_nominal"])
            assert m["size_mb"] == pytest.approx(pack["file_bytes"] / 1e6)
            assert (work / f"models/packed/{m['format']}/{m['method']}/model.safetensors").exists()
    bench = json.loads((work / "reports/bench.json").read_text())
    assert bench and (work / "reports/bench.md").exists() and (work / "reports/summary.md").exists()
    status = _run([str(BIN / "dvc"), "status"], work)
    assert "changed" not in status, status

    # Share the results as a user would: push from this clone, pull into a fresh one; nothing is left to run.
    remote = tmp_path / "remote"
    _run([str(BIN / "dvc"), "remote", "modify", "--local", "local", "url", str(remote)], work)
    _run(["git", "add", "-A"], work)
    _run(["git", "-c", "user.email=ci@example.com", "-c", "user.name=ci", "commit", "-qm", "results"], work)
    _run([str(BIN / "dvc"), "push"], work)
    clone = tmp_path / "clone"
    _run(["git", "clone", "-q", str(work), str(clone)], tmp_path)
    _run([str(BIN / "dvc"), "remote", "modify", "--local", "local", "url", str(remote)], clone)
    _run([str(BIN / "dvc"), "pull"], clone)
    for built in REPO.glob("pipeline/_s3d8_native*.so"):
        shutil.copy2(built, clone / "pipeline" / built.name)
    status = _run([str(BIN / "dvc"), "status"], clone)
    assert "changed" not in status and "deleted" not in status, status
    assert "Running stage" not in _run([str(BIN / "dvc"), "repro"], clone)


@pytest.mark.slow
def test_dvc_repro_text_llama_slice(tmp_path):
    """The text path (issue 25) as CI can run it: configs/smollm2-135m.yaml with the teacher swapped for a tiny
    Llama GGUF the test writes (byte-level tokenizer, chat template), a few QAT steps on S3D8 and INT, then the
    packed directory loads through transformers and `s3d8 generate` answers from it."""
    sys.path.insert(0, str(REPO / "tests"))
    from test_teacher_import import byte_vocabulary, tiny_llama, write_tiny_llama_gguf

    work = tmp_path / "repo"
    work.mkdir()
    _copy_tree(work)
    _run(["git", "init", "-q"], work)
    _run(["git", "-c", "user.email=ci@example.com", "-c", "user.name=ci", "commit", "-qm", "copy", "--allow-empty"], work)
    vocab = byte_vocabulary()
    gguf_path = write_tiny_llama_gguf(tmp_path / "tiny-llama.gguf", tiny_llama(vocab_size=len(vocab)), tokens=vocab)
    (work / "slice.yaml").write_text(
        f"teacher: {{source: {gguf_path}, name: tiny-llama}}\nformats: [s3d8, int]\nheldout_prompts: 8\n"
        "sample: {n_prompts: 48, shard_size: 24}\ngenerate: {max_new_tokens: 12}\ncalibrate: {n_prompts: 16}\n"
        "qat: {steps: 4, batch_size: 4, checkpoint_every: 2}\n"
        "eval: {perplexity_tokens: 600, perplexity_window: 200, sample_tokens: 8}\n")
    _run([str(BIN / "python"), "-m", "pipeline.params", "apply", "configs/smollm2-135m.yaml"], work)
    _run([str(BIN / "python"), "-m", "pipeline.params", "apply", "slice.yaml"], work)
    log = _run([str(BIN / "dvc"), "repro", "eval"], work)
    assert "Running stage 'toy-teacher'" not in log

    imported = json.loads((work / "models/teacher/teacher_import.json").read_text())
    assert imported["kind"] == "gguf" and imported["file"] == "tiny-llama.gguf"
    rotate = yaml.safe_load((work / "configs/smollm2-135m.yaml").read_text())["teacher"]["rotate"]
    assert imported["rotate"] == {"kind": rotate, "seed": 0, "dtype": "float32"}      # the preset rotates
    from pipeline.packed.file import read_metadata

    assert read_metadata(work / "models/packed/s3d8/qat/model.safetensors")["rotate"] == rotate
    result = json.loads((work / "reports/eval.json").read_text())["models"]
    assert set(result) == {"bf16-teacher", "s3d8-direct-cast", "s3d8-qat", "int-direct-cast", "int-qat"}
    assert result["bf16-teacher"]["kl"] == 0 and result["bf16-teacher"]["top1_agreement"] == 1
    for name, m in result.items():
        assert m["perplexity"] > 1 and 0 <= m["top1_agreement"] <= 1 and m["kl"] >= 0, name
    assert "Generation samples" in (work / "reports/summary.md").read_text()
    history = (work / "reports/qat/s3d8/plots/metrics/train/kl.tsv").read_text().splitlines()
    assert len(history) == 1 + 4                                   # 4 steps of KL on response tokens
    status = _run([str(BIN / "dvc"), "status", "eval"], work)
    assert "changed" not in status, status

    packed = work / "models/packed/s3d8/qat"
    check = ("import sys, torch, pipeline; from transformers import AutoModelForCausalLM; "
             f"m = AutoModelForCausalLM.from_pretrained('{packed}'); "
             "print(type(m).__name__, m.config.quantization_config.quant_method)")
    assert "LlamaForCausalLM s3d8" in _run([str(BIN / "python"), "-c", check], work)
    out = _run([str(BIN / "python"), "-m", "pipeline.runtime.generation", str(packed), "--prompt", "Explain the tides.",
                "--max-new-tokens", "5"], work)
    assert "[llama s3d8, lean" in out and "prompt 34 tokens" in out, out     # the chat template, not byte tokens
