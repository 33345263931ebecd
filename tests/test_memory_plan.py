"""The memory plan (pipeline/launch/memory_plan.py, ``python -m pipeline.launch plan``): terms per stage and phase from the
params and the teacher's config, the check that names what does not fit, and the launcher's refusal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline import params
from pipeline.launch import memory_plan

ROOT = Path(__file__).resolve().parent.parent


def _params(tmp_path, teacher_dir, **sections) -> Path:
    doc = yaml.safe_load((ROOT / "params.yaml").read_text())
    doc["teacher"]["dir"] = str(teacher_dir)
    for section, values in sections.items():
        doc[section] = {**doc[section], **values} if isinstance(values, dict) else values
    out = tmp_path / "params.yaml"
    out.write_text(yaml.safe_dump(doc))
    return out


def test_plan_terms_follow_the_launch_settings(tmp_path, tiny_checkpoint):
    teacher = Path(tiny_checkpoint)
    ddp = memory_plan.plan(params.read(_params(tmp_path, teacher)))
    stages = {ph.stage for ph in ddp}
    assert {"teacher-generate", "calibrate", "direct-cast", "fit-centroids", "qat-train", "pack-safetensors",
            "eval"} <= stages
    train = next(ph for ph in ddp if (ph.stage, ph.phase) == ("qat-train", "train")).device
    assert {"masters_fp32", "grads_fp32", "adamw", "activations", "logits", "kl_cache"} <= set(train)
    fsdp = memory_plan.plan(params.read(_params(tmp_path, teacher, launch={"num_processes": 4, "strategy": "fsdp2",
                                                                           "teacher": "shard"},
                                               qat={"teacher_logits": "forward", "batch_size": 16, "grad_accum": 1})))
    sharded = next(ph for ph in fsdp if (ph.stage, ph.phase) == ("qat-train", "train")).device
    assert sharded["adamw"] == pytest.approx(train["adamw"] / 4)            # moments sharded 4 ways
    assert "kl_cache" not in sharded and sharded["teacher"] < train["teacher"]
    ckpt = memory_plan.plan(params.read(_params(tmp_path, teacher, launch={"gradient_checkpointing": True})))
    assert next(ph for ph in ckpt if ph.phase == "train").device["activations"] < train["activations"]


def test_check_names_the_phase_and_its_largest_terms(tmp_path, tiny_checkpoint):
    phases = memory_plan.plan(params.read(_params(tmp_path, Path(tiny_checkpoint))))
    assert memory_plan.check(phases, None, 64e9, 1) == []
    problems = memory_plan.check(phases, None, 1e6, 2, stage="qat-train")
    assert problems and all(p.startswith("qat-train (") for p in problems)
    assert "activations (x2 processes)" in " ".join(problems)
    on_gpu = memory_plan.check(phases, 1e6, 64e9, 2)
    assert any("per GPU" in p and "teacher-generate" in p for p in on_gpu)


def _preset_11b():
    from pipeline.bench import skeleton_11b_steps as skeleton_11b

    config = skeleton_11b.full_11b_config()
    doc = yaml.safe_load((ROOT / "params.yaml").read_text())
    for preset in ("configs/llama-3.2-11b-vision.yaml", "configs/launch/gpu8-fsdp2-11b.yaml"):
        doc = params.merge(doc, yaml.safe_load((ROOT / preset).read_text()))
    return params.validate(doc), config, memory_plan.count_params(config)


def test_the_readme_gives_the_host_ram_the_11b_plan_gives():
    """Rank 0's load and save in qat-train, teacher-generate's and eval's node (every rank its bf16 teacher)."""
    p, config, counts = _preset_11b()
    host = {(ph.stage, ph.phase): ph.total("host") / 1e9 for ph in memory_plan.plan(p, config, counts)}
    readme = (ROOT / "README.md").read_text().replace("\n", " ")
    said = (f"rank 0 reads the fp32 student ({host['qat-train', 'load student']:.0f} GB of host RAM) and holds "
            f"{host['qat-train', 'save']:.0f} GB while it saves it; every teacher-generate rank loads its bf16 teacher "
            f"({host['teacher-generate', 'generate']:.0f} GB a node), every eval rank too "
            f"({host['eval', 'lazy load']:.0f} GB a node with the packed model it scores)")
    assert said in " ".join(readme.split()), said


def test_the_11b_preset_fits_8_gpus_of_80_gb():
    """The README's 11B run (its preset and the 8-GPU launch preset) on the real config's counts: QAT fits an
    80 GB GPU only with what the launch preset turns on (sharded teacher, checkpointing, bf16 compute)."""
    p, config, counts = _preset_11b()
    phases = memory_plan.plan(p, config, counts)
    assert memory_plan.check(phases, 80e9, 2e12, 8, stage="qat-train") == []
    train = next(ph for ph in phases if ph.phase == "train")
    assert 30e9 < train.total("device") < 60e9
    p["launch"].gradient_checkpointing = False
    problems = memory_plan.check(memory_plan.plan(p, config, counts), 80e9, 2e12, 8, stage="qat-train")
    assert problems and "activations" in problems[0]


def test_cli_prints_the_plan_and_the_launcher_refuses_what_does_not_fit(tmp_path, tiny_checkpoint):
    path = _params(tmp_path, Path(tiny_checkpoint))
    run = subprocess.run([sys.executable, "-m", "pipeline.launch", "plan", "--params", str(path)],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert "qat-train" in run.stdout and "adamw" in run.stdout and "host RAM per node" in run.stdout
    run = subprocess.run([sys.executable, "-m", "pipeline.launch", "plan", "--params", str(path), "--host-memory-gb",
                          "0.001"], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 1 and "does not fit: qat-train (train)" in run.stderr
    big = _params(tmp_path, Path(tiny_checkpoint), qat={"batch_size": 1 << 20, "grad_accum": 1})
    run = subprocess.run([sys.executable, "-m", "pipeline.launch", "--params", str(big), "stages/qat_train.py"],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 1 and "memory plan does not fit" in run.stderr and "logits" in run.stderr


def test_a_tied_embedding_counts_once():
    """SmolLM2 ties lm_head to the token embedding: the quantised count holds the shared weight once (it was
    counted twice, which made the lazy eval model's size negative)."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    counts = memory_plan.count_params(config)
    assert counts["quantised"] <= counts["total"] and counts["lm_head"] == 0
    assert memory_plan.step_host(counts)["load_lazy"] > 0


def test_disk_terms_follow_the_config_and_the_formats(tmp_path, tiny_checkpoint):
    """Each stage's disk from the parameter counts: the teacher in bf16, X^T X in fp32 per Linear (sum d_in^2 * 4),
    each format's casts (packed bytes + fp32 masters), the fp32 students, two QAT checkpoints of fp32 masters and
    AdamW's two moments while the next is written, and DVC's cache copy of every cached output."""
    import torch

    from pipeline import formats
    from pipeline.models import load_config, meta_model
    from pipeline.recipe import quantised_modules

    p = params.read(_params(tmp_path, Path(tiny_checkpoint), qat={"steps": 100, "checkpoint_every": 25}))
    counts = memory_plan.count_params(load_config(str(tiny_checkpoint)))
    P, Q = counts["total"], counts["quantised"]
    phases = {(ph.stage, ph.phase): ph for ph in memory_plan.plan(p, counts=counts)}
    assert phases["teacher-import", "write"].disk == {"teacher_bf16": 2 * P, "dvc_cache_copy": 2 * P}
    linears = [m for _, m in quantised_modules(meta_model(load_config(str(tiny_checkpoint))))
               if isinstance(m, torch.nn.Linear)]
    assert phases["calibrate", "forward"].disk["hessians_fp32"] == 4 * sum(m.in_features ** 2 for m in linears)
    casts = sum(formats.get(f).storage_bytes(s) for f in p["formats"] for s in counts["quantised_shapes"])
    assert phases["direct-cast", "largest layer"].disk["casts"] == casts + 4 * Q * len(p["formats"])
    assert phases["qat-train", "train"].scratch == {"checkpoints_x2": 2 * 12 * P}
    assert phases["qat-train", "save"].disk["students_fp32"] == 4 * P * len(p["formats"])
    assert phases["qat-train", "save"].scratch == {"last_checkpoint": 12 * P}
    one = params.read(_params(tmp_path, Path(tiny_checkpoint), qat={"steps": 30, "checkpoint_every": 25},
                              formats=["int"]))
    plain = {(ph.stage, ph.phase): ph for ph in memory_plan.plan(one, counts=counts, cache_copies=False)}
    assert plain["qat-train", "train"].scratch == {"checkpoints_x1": 12 * P}
    assert "export-sqt" not in {s for s, _ in plain} and all("dvc_cache_copy" not in ph.disk for ph in plain.values())


def test_the_plan_and_the_launcher_refuse_a_run_the_disk_cannot_hold(tmp_path, tiny_checkpoint, monkeypatch, capsys):
    """Free disk (shutil.disk_usage, monkeypatched) between what the stages before qat-train leave and what its two
    checkpoints add: the plan exits 1 naming qat-train (train) and the numbers; with less free than the checkpoints
    the launcher refuses qat-train and starts pack-safetensors, whose outputs fit."""
    import shutil

    from pipeline.launch import launcher as launch

    path = _params(tmp_path, Path(tiny_checkpoint), qat={"steps": 100, "checkpoint_every": 25}, formats=["s3d8"])
    phases = memory_plan.plan(params.read(path))
    free = {"project": (tmp_path, 1e15)}
    need = {(ph.stage, ph.phase): left + sum(own.values()) for ph, _, left, own in memory_plan.disk_needs(phases, free)}
    checkpoints = next(ph for ph in phases if ph.phase == "train").scratch["checkpoints_x2"]
    limit = int(need["direct-cast", "largest layer"] + checkpoints / 4)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=limit))
    assert launch.plan_main(["--params", str(path), "--host-memory-gb", "1000"]) == 1
    err = capsys.readouterr().err
    assert (f"does not fit: qat-train (train): {need['qat-train', 'train'] / 1e6:.2f} MB of disk at {ROOT} > "
            f"{limit / 1e6:.2f} MB free; left by the stages before it") in err
    assert f"checkpoints_x2 {checkpoints / 1e6:.2f} MB" in err and err.count("does not fit") == 1
    # the launcher checks the stage alone: what the stages before it left is on disk (not free) already
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=int(checkpoints / 2)))
    with pytest.raises(ValueError, match=r"memory plan does not fit.*qat-train \(train\): .* MB of disk"):
        launch._memory_check("stages/qat_train.py", ["--format", "s3d8"], str(path), launch.from_file(path))
    launch._memory_check("stages/pack_safetensors.py", ["--format", "s3d8"], str(path), launch.from_file(path))


def test_dvc_cache_settings_decide_where_copies_go(tmp_path):
    (tmp_path / ".dvc").mkdir()
    assert memory_plan.dvc_cache(tmp_path) == (tmp_path / ".dvc" / "cache", True)
    (tmp_path / ".dvc" / "config").write_text("[core]\n    remote = local\n[cache]\n    dir = ../store\n"
                                              "    type = hardlink,symlink\n")
    assert memory_plan.dvc_cache(tmp_path) == (tmp_path / ".dvc" / "../store", False)
    free = memory_plan.disk_available(tmp_path, tmp_path / ".dvc" / "../store")
    assert list(free) == ["project"] and free["project"][0] == tmp_path.resolve()    # one file system: one budget


def test_the_plan_names_the_model_of_the_preset_it_was_given(tmp_path, tiny_checkpoint, monkeypatch, capsys):
    """A clone that imported the toy (teacher.dir holds it, teacher_import.json says so): ``--preset`` naming another
    teacher plans that one from its local config.json and says so; a teacher whose config is not here is one error
    naming it and the download; a hub id's config.json is read from the Hugging Face cache, never downloaded."""
    import shutil

    import huggingface_hub

    from pipeline.launch import launcher as launch
    from pipeline.models import load_config

    toy = tmp_path / "teacher"
    toy.mkdir()
    shutil.copy(ROOT / "data/toy-teacher/config.json", toy / "config.json")
    (toy / "teacher_import.json").write_text('{"source": "data/toy-teacher"}')
    path = _params(tmp_path, toy)
    preset = tmp_path / "other.yaml"
    preset.write_text(yaml.safe_dump({"teacher": {"source": str(tiny_checkpoint), "name": "tiny-other"},
                                      "formats": ["s3d8"]}))
    assert launch.plan_main(["--params", str(path), "--host-memory-gb", "1000"]) == 0
    assert capsys.readouterr().out.startswith(f"plan of toy-mllama: MllamaForConditionalGeneration, 0.00 B "
                                              f"parameters (0.00 B quantised), config {toy / 'config.json'}\n")
    assert launch.plan_main(["--params", str(path), "--preset", str(preset), "--host-memory-gb", "1000"]) == 0
    out = capsys.readouterr().out
    total = memory_plan.count_params(load_config(str(tiny_checkpoint)))["total"]
    assert out.startswith(f"plan of tiny-other: MllamaForConditionalGeneration, {total / 1e9:.2f} B parameters")
    assert f"config {tiny_checkpoint / 'config.json'}\nparams {path} + {preset}: 1 process(es), ddp, formats s3d8" in out

    preset.write_text(yaml.safe_dump({"teacher": {"source": str(tmp_path / "absent")}}))
    assert launch.plan_main(["--params", str(path), "--preset", str(preset)]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'absent'}: no config.json here" in err and "teacher.dir" in err and "hf download" in err

    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "0123"
    snapshot.mkdir(parents=True)
    shutil.copy(Path(tiny_checkpoint) / "config.json", snapshot / "config.json")
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("0123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert launch.plan_main(["--params", str(path), "--config", "org/tiny", "--host-memory-gb", "1000"]) == 0
    assert f"config {snapshot / 'config.json'}" in capsys.readouterr().out
    assert launch.plan_main(["--params", str(path), "--config", "org/absent"]) == 1
    assert "org/absent: no config.json" in capsys.readouterr().err


def test_the_plan_gives_each_wait_for_rank_0_a_timeout_from_its_bytes():
    from datetime import timedelta

    from pipeline.launch import ranks

    p, config, counts = _preset_11b()
    lines = ranks.planned_waits(p, counts)
    student = next(line for line in lines if "writes the fp32 student" in line)
    assert f"{4 * counts['total'] / 1e9:.1f} GB" in student
    assert str(timedelta(seconds=p["launch"].timeout_s + 4 * counts["total"] / (p["launch"].min_disk_mb_s * 1e6))) \
        in student
    p["launch"].num_processes = 1
    assert ranks.planned_waits(p, counts) == []
