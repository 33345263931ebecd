"""The 11B-shaped skeleton's code paths that run without a GPU or gigabytes: the memory model on a tiny config,
the tiny skeleton built like a hub checkpoint and run, and gpu_check's no-GPU exit (pipeline/bench/skeleton_11b.py,
pipeline/bench/gpu_check.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

from pipeline.bench import skeleton_11b_steps as S  # noqa: E402

from pipeline.launch import memory_plan  # noqa: E402


def test_count_params_matches_a_built_model():
    from transformers import MllamaForConditionalGeneration

    config = S.skeleton_config(S.PRESETS["tiny"])
    counts = S.count_params(config)
    torch.manual_seed(0)
    model = MllamaForConditionalGeneration(config)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["quantised"] <= counts["total"]
    assert counts["text_self_layers"] == 2 and counts["text_cross_layers"] == 1
    assert counts["embed"] == (config.text_config.vocab_size + 8) * config.text_config.hidden_size


def test_memory_model_on_a_tiny_config():
    config = S.skeleton_config(S.PRESETS["tiny"])
    counts = S.count_params(config)
    P = counts["total"]
    w = S.Workload(micro_batch=2, seq=32, tiles=1)
    m = S.qat_memory(config, devices=4, workload=w, teacher="shard", checkpointing=True, counts=counts)
    parts = m["parts"]
    assert parts["masters_fp32"] == pytest.approx(4 * P / 4)
    assert parts["grads_fp32"] == pytest.approx(4 * P / 4 + 4 * counts["largest_unit"])   # + a unit before its reduce-scatter
    assert parts["adamw"] == pytest.approx(8 * P / 4)
    assert m["total"] == pytest.approx(sum(parts.values()))
    assert m["host_load"] == 6 * P
    replicated = S.qat_memory(config, devices=4, workload=w, teacher="replicate", checkpointing=True, counts=counts)
    assert replicated["parts"]["teacher"] == 2 * P
    no_ckpt = S.qat_memory(config, devices=4, workload=w, teacher="shard", checkpointing=False, counts=counts)
    assert no_ckpt["parts"]["activations"] > parts["activations"]
    assert no_ckpt["parts"]["saved_quantised_weights"] > parts["saved_quantised_weights"]
    # sharded state falls as 1/devices; activations do not depend on the device count
    m8 = S.qat_memory(config, devices=8, workload=w, teacher="shard", checkpointing=True, counts=counts)
    assert m8["parts"]["adamw"] == pytest.approx(parts["adamw"] / 2)
    assert m8["parts"]["activations"] == parts["activations"]
    # logits scale with tokens x vocabulary
    w2 = S.Workload(micro_batch=4, seq=32, tiles=1)
    assert memory_plan.activation_bytes(config, counts, w2, 2, True)["logits"] == \
        pytest.approx(2 * memory_plan.activation_bytes(config, counts, w, 2, True)["logits"])
    steps = S.step_memory(counts, base=0.5e9)
    assert steps["load_eager"] > steps["load_lazy"] > 0.5e9


def test_the_11b_counts_from_config_defaults():
    counts = S.count_params(S.full_11b_config())
    assert 10.6e9 < counts["total"] < 10.7e9           # Llama 3.2 11B Vision: 10.67 B parameters
    assert counts["text_self_layers"] == 32 and counts["text_cross_layers"] == 8
    assert counts["vision_local_layers"] == 32 and counts["vision_global_layers"] == 8
    assert counts["largest_matrix"] == 128264 * 4096     # the token embedding (128,256 + 8 rows)


def test_tiny_skeleton_builds_loads_and_runs(tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    size = S.PRESETS["tiny"]
    info = S.build(tmp_path / "model", size, seed=3)
    again = S.build(tmp_path / "again", size, seed=3)
    assert info == again
    a = (tmp_path / "model" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "again" / "model.safetensors").read_bytes()          # seeded: the same bytes
    processor = AutoProcessor.from_pretrained(str(tmp_path / "model"))
    tok = processor.tokenizer
    assert tok.convert_tokens_to_ids("<|image|>") == size.vocab_size
    specials = S.special_ids(size.vocab_size)
    assert tok.convert_tokens_to_ids("<|eot_id|>") == specials["<|eot_id|>"]
    model = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "model"), dtype=torch.float32).eval()
    assert model.config.text_config.eos_token_id == [specials["<|end_of_text|>"], specials["<|eom_id|>"],
                                                     specials["<|eot_id|>"]]
    inputs = S.prompt_inputs(processor, size.max_num_tiles)
    assert int((inputs["input_ids"] == size.vocab_size).sum()) == 1
    with torch.no_grad():
        logits = model(**inputs).logits
    assert torch.isfinite(logits).all() and logits.shape[-1] == size.vocab_size
    pad = model.config.text_config.pad_token_id
    assert float(model.model.language_model.embed_tokens.weight[pad].detach().abs().sum()) == 0.0


def test_phases_record_peaks():
    phases = S.Phases()
    with phases("grow"):
        x = torch.ones(100_000_000)                     # 400 MB, every page written
        del x
    rec = phases.records["grow"]
    # Other pages of the process (shared libraries, page cache) may be reclaimed meanwhile on a busy machine,
    # so the bound leaves room: a peak that was not reset or not read would miss the 400 MB entirely.
    assert rec["peak_rss_gb"] >= rec["rss_start_gb"] + 0.3
    assert rec["peak_rss_gb"] >= rec["rss_end_gb"]


def test_gpu_check_without_a_gpu_says_so():
    from pipeline.bench import gpu_check

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    reason = gpu_check.no_gpu_reason()
    assert reason and "no CUDA GPU" in reason
    assert gpu_check.main([]) == gpu_check.NO_GPU_STATUS
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(["bash", str(ROOT / "pipeline" / "bench" / "gpu_check.sh"), "--steps", "1"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "gpu_check: no CUDA GPU visible" in proc.stderr
    p = gpu_check.predicted("tiny", batch=2, seq=32)
    assert p["total_gb"] > 0 and "adamw" in p["parts_gb"]


def test_gpu_check_cpu_side_builds_the_tiny_skeleton_and_its_states(tmp_path, monkeypatch):
    from pipeline.bench import gpu_check
    from pipeline import formats
    from pipeline.models import meta_model, quantised_weight_names

    monkeypatch.setattr(S, "WORK", tmp_path)
    info = gpu_check.ensure_skeleton("tiny", fit=False)
    assert "shared" in info["states"]
    states = formats.get("s3d8").load_states(S.dirs("tiny")["states"])
    names = quantised_weight_names(meta_model(S.skeleton_config(S.PRESETS["tiny"])))
    assert set(states) == {saved.removesuffix(".weight") for saved in names.values()}
    assert gpu_check.ensure_skeleton("tiny", fit=False) == {"model_dir": str(S.dirs("tiny")["model"])}   # reused


def test_gpu_check_dry_run_on_the_cpu(tmp_path, monkeypatch):
    """The GPU check's code on the CPU (tiny skeleton): the direct cast it times is the stage's and QAT starts
    from it; without dvclive the per-step metrics land in its JSON."""
    from pipeline.bench import gpu_check
    from pipeline import formats
    from pipeline.cast.direct import DirectCast

    monkeypatch.setattr(S, "WORK", tmp_path)
    monkeypatch.setitem(sys.modules, "dvclive", None)          # as on a GPU machine without dvc
    monkeypatch.setattr(gpu_check.StepLog, "records", [])
    out = tmp_path / "gpu_check.json"
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    before = {k: os.environ.get(k) for k in keys}
    assert gpu_check.main(["--device", "cpu", "--preset", "tiny", "--steps", "2", "--batch", "2", "--seq", "48",
                           "--gen-prompts", "2", "--gen-tokens", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    cast = r["cast"]
    assert cast["matrices"] == 45 and cast["cpu_vs_device"]["packed_bytes_equal"] == 1.0
    assert [p["processes"] for p in cast["predicted_11b"]] == [1, 8]
    assert cast["predicted_11b"][1]["seconds"] < cast["predicted_11b"][0]["seconds"]
    DirectCast(cast["out_dir"], formats.get("s3d8"))                   # a direct cast the stage's reader takes
    assert r["qat"]["init"] == "ptq" and [m["step"] for m in r["qat"]["step_metrics"]] == [1, 2]
    assert r["generate"]["generated_tokens"] > 0
    assert {k: os.environ.get(k) for k in keys} == before       # no rendezvous left for later stages to trip on
