"""The pipeline's stage scripts on a tiny untrained teacher: they run in order, resume after a kill with
the same result, and stop with a clear message on bad input."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors import safe_open

from tests.stage_helpers import build_tiny_teacher, run_stage, run_stage_killed_after, workdir

STAGES = Path(__file__).resolve().parent.parent / "stages"

CHAIN = [("fit_centroids.py", "--format", "s3d8"), ("sample_prompts.py",), ("teacher_generate.py",),
         ("calibrate.py",), ("direct_cast.py", "--format", "s3d8"), ("qat_train.py", "--format", "s3d8"), ("pack_safetensors.py", "--format", "s3d8"), ("eval.py",)]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return build_tiny_teacher(tmp_path_factory.mktemp("teacher"))


@pytest.fixture(scope="module")
def chain(tmp_path_factory, teacher):
    """Every stage once, uninterrupted: the reference run."""
    cwd = workdir(tmp_path_factory.mktemp("chain"), teacher)
    for script, *args in CHAIN:
        run_stage(cwd, script, *args)
    return cwd


def test_chain_outputs(chain):
    result = json.loads((chain / "reports/eval.json").read_text())
    assert set(result["models"]) == {"bf16-teacher", "s3d8-direct-cast", "s3d8-qat"}
    for name, m in result["models"].items():
        assert set(m) == {"format", "method", "bpp", "size_mb", "kl", "scores", "avg"}
        assert set(m["scores"]) == {"toy-vqa", "toy-chartqa", "toy-docvqa", "toy-ai2d"}
        assert m["avg"] == pytest.approx(sum(m["scores"].values()) / 4)
    assert result["models"]["s3d8-qat"]["bpp"] == pytest.approx(
        json.loads((chain / "reports/pack/s3d8.json").read_text())["qat"]["bits_per_param_nominal"])
    assert result["models"]["s3d8-qat"]["kl"] > 0 and result["models"]["bf16-teacher"]["kl"] == 0
    with safe_open(str(chain / "models/packed/s3d8/qat/model.safetensors"), "pt") as f:
        assert f.metadata()["llama_mobile_format"] == "llama-mobile-s3d8-packed-v1"
    assert (chain / "reports/summary.md").read_text().count("| s3d8-") == 2
    assert (chain / "reports/eval_plot.png").stat().st_size > 1000
    assert len(list((chain / "reports/answers").glob("*.parquet"))) == 3
    history = (chain / "reports/qat/s3d8/plots/metrics/train/kl.tsv").read_text().splitlines()
    assert len(history) == 1 + 4, "one KL record per step"
    gen = json.loads((chain / "reports/teacher_generate.json").read_text())
    assert gen["responses"] == 24 and 0 < gen["length_mean"] <= 6


def test_sample_prompts_is_deterministic(chain, tmp_path, teacher):
    cwd = workdir(tmp_path, teacher)
    run_stage(cwd, "sample_prompts.py")
    for ref in sorted((chain / "data/sampled").glob("*.parquet")):
        assert (cwd / "data/sampled" / ref.name).read_bytes() == ref.read_bytes()


def test_teacher_generate_resumes_after_a_kill(chain, tmp_path, teacher):
    cwd = workdir(tmp_path, teacher)
    shutil.copytree(chain / "data/sampled", cwd / "data/sampled")
    run_stage_killed_after(cwd, "pipeline.files.shards.write_shard", "teacher_generate.py")
    work = cwd / "checkpoints/teacher-generate"
    done = sorted(p.name for p in work.glob("shard-*.parquet"))
    assert done == ["shard-00000.parquet"], done
    assert not (cwd / "data/teacher").exists()          # the DVC output appears only whole
    # A truncated shard (a crash mid-write elsewhere) is regenerated, not trusted.
    (work / "shard-00001.parquet").write_bytes(b"PAR1 truncated")
    log = run_stage(cwd, "teacher_generate.py").stderr
    assert "already done" in log
    assert sorted(p.name for p in (cwd / "data/teacher").iterdir()) == \
        sorted(p.name for p in (chain / "data/teacher").iterdir())        # no stray file in the output
    for ref in sorted((chain / "data/teacher").glob("*.parquet")):
        assert (cwd / "data/teacher" / ref.name).read_bytes() == ref.read_bytes()


def test_qat_train_resumes_after_a_kill_with_the_same_result(chain, tmp_path, teacher):
    cwd = workdir(tmp_path, teacher, **{"qat.checkpoint_every": 1})
    for part in ("data/sampled", "data/teacher", "data/centroids", "data/calibration", "models/direct-cast"):
        shutil.copytree(chain / part, cwd / part)
    run_stage_killed_after(cwd, "pipeline.qat.engines.save_checkpoint", "qat_train.py", "--format", "s3d8")
    assert (cwd / "checkpoints/qat/s3d8.safetensors").exists()
    log = run_stage(cwd, "qat_train.py", "--format", "s3d8").stderr
    assert "resuming at step" in log
    with safe_open(str(chain / "models/qat/s3d8/model.safetensors"), "pt") as a, \
            safe_open(str(cwd / "models/qat/s3d8/model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for key in a.keys():
            assert a.get_tensor(key).equal(b.get_tensor(key)), key
    assert not (cwd / "checkpoints/qat/s3d8.safetensors").exists()
    kl = (cwd / "reports/qat/s3d8/plots/metrics/train/kl.tsv").read_text()
    assert kl == (chain / "reports/qat/s3d8/plots/metrics/train/kl.tsv").read_text()
    # each step's and checkpoint's wall seconds go to the run log, not to the metrics: those of this process's steps
    run = json.loads((cwd / "logs/qat-train-s3d8.json").read_text())
    resumed = int(re.search(r"resuming at step (\d+)", log).group(1))
    assert resumed >= 1 and run["checkpoint_every"] == 1
    assert len(run["step_s"]) == run["steps"] - resumed and len(run["checkpoint_s"]) == len(run["step_s"]) - 1
    assert all(t >= 0 for t in run["step_s"] + run["checkpoint_s"])


def test_a_planted_pickle_never_runs_and_training_starts_afresh(chain, tmp_path, teacher):
    cwd = workdir(tmp_path, teacher, **{"qat.steps": 2})
    for part in ("data/teacher", "data/centroids", "data/calibration", "models/direct-cast"):
        shutil.copytree(chain / part, cwd / part)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    import pickle
    (cwd / "checkpoints/qat").mkdir(parents=True)
    (cwd / "checkpoints/qat/s3d8.safetensors").write_bytes(pickle.dumps(Evil()))
    log = run_stage(cwd, "qat_train.py", "--format", "s3d8").stderr
    assert not marker.exists()
    assert "not a readable checkpoint" in log and "starting afresh" in log


def test_calibrate_and_pack_by_gptq(chain, tmp_path, teacher):
    """calibrate holds X^T X for every quantised Linear (symmetric, finite); pack.algorithm=gptq (the default) uses
    it: its direct cast has a lower output error tr(dW H dW^T) on the calibration set than the scale search's, with
    calibrate.act_order or without it (the default; other codes, recorded in the cast's index)."""
    import torch

    from pipeline.packed.checkpoint import CheckpointReader
    from pipeline.models import load_config, meta_model, quantised_weight_names
    from pipeline.packed.file import load_packed_model

    with safe_open(str(chain / "data/calibration/hessians.safetensors"), "pt") as f:
        hessians = {k: f.get_tensor(k) for k in f.keys()}
        assert int(f.metadata()["prompts"]) == 20         # 24 answers less 4 held out, all of them
    assert any(k.endswith("down_proj") for k in hessians) and not any("embed" in k for k in hessians)
    for name, h in hessians.items():
        assert torch.isfinite(h).all() and torch.equal(h, h.T) and bool((h.diagonal() >= 0).all()), name
    runs = {"gptq": chain}
    for name, setting in (("search", {"pack.algorithm": "search"}), ("act-order", {"calibrate.act_order": True})):
        runs[name] = cwd = workdir(tmp_path / name.replace(" ", "-"), teacher, **setting)
        for part in ("data/centroids", "data/calibration", "models/qat"):
            shutil.copytree(chain / part, cwd / part)
        run_stage(cwd, "direct_cast.py", "--format", "s3d8")
        run_stage(cwd, "pack_safetensors.py", "--format", "s3d8")
    index = {k: json.loads((root / "models/direct-cast/s3d8/index.json").read_text()) for k, root in runs.items()}
    assert [index[k]["metadata"]["act_order"] for k in ("gptq", "act-order")] == [False, True], index
    teacher_w = CheckpointReader(teacher)
    module_of = {saved.removesuffix(".weight"): module
                 for module, saved in quantised_weight_names(meta_model(load_config(str(teacher)))).items()}
    errors = {}
    for algorithm, root in runs.items():
        model = load_packed_model(root / "models/packed/s3d8/direct-cast/model.safetensors", act_quant=False)
        total = 0.0
        for name, h in hessians.items():
            dw = model.get_submodule(module_of[name]).weight.float() - teacher_w.get(f"{name}.weight").float()
            total += float(torch.einsum("ij,jk,ik->", dw, h, dw))
        errors[algorithm] = total
    assert errors["gptq"] < errors["search"] and errors["act-order"] < errors["search"], errors
    assert errors["act-order"] != errors["gptq"], errors


def test_qat_from_the_ptq_point_with_learned_scales_and_a_table_refit(chain, tmp_path, teacher):
    """qat.init ptq + learn_scales + refit_table: the student's masters keep the teacher's layout (no scale
    tensors), qat_state.safetensors holds a table and a bf16 scale per quantised weight, and the packed QAT model
    is exactly those: its scales are the trained ones and its weights decode to the fake-quant forward."""
    import torch

    from pipeline import formats
    from pipeline.packed.checkpoint import CheckpointReader

    cwd = workdir(tmp_path, teacher, **{"qat.init": "ptq", "qat.learn_scales": True, "qat.scale_lr": 1e-2,
                                        "qat.refit_table": True})
    for part in ("data/teacher", "data/centroids", "data/calibration", "models/direct-cast"):
        shutil.copytree(chain / part, cwd / part)
    run_stage(cwd, "qat_train.py", "--format", "s3d8")
    run_stage(cwd, "pack_safetensors.py", "--format", "s3d8")
    summary = json.loads((cwd / "reports/qat/s3d8/summary.json").read_text())
    assert summary["init"] == "ptq" and summary["learn_scales"] and summary["refit_table"]["matrices"] > 0
    student = CheckpointReader(cwd / "models/qat/s3d8")
    assert not any("qat_" in k for k in student.keys())
    with safe_open(str(cwd / "models/qat/s3d8/qat_state.safetensors"), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    weights = sorted(k.removesuffix(".scale") for k in state if k.endswith(".scale"))
    assert weights and sorted(k.removesuffix(".table") for k in state if k.endswith(".table")) == weights
    fmt = formats.get("s3d8")
    packed = safe_open(str(cwd / "models/packed/s3d8/qat/model.safetensors"), "pt")
    for name in weights:
        w = student.get(f"{name}.weight").float()
        tensors = {k: packed.get_tensor(f"{name}.weight.{k}") for k in fmt.suffixes}
        assert torch.equal(tensors["scale"], state[f"{name}.scale"]) and torch.equal(tensors["table"], state[f"{name}.table"])
        want = fmt.unpack(fmt.pack_at_scale(w, {"table": state[f"{name}.table"]}, state[f"{name}.scale"]),
                          tuple(w.shape))
        assert torch.equal(fmt.unpack(tensors, tuple(w.shape)), want), name


def test_a_direct_cast_packed_alone_before_any_qat(chain, tmp_path, teacher):
    """pack-safetensors --methods direct-cast --out DIR: the direct cast's directory, byte for byte the stage's,
    without a QAT student; the stage's own models/packed/ and reports/pack/ are left alone, and not giving --out
    is refused rather than replacing the stage's output with half of it."""
    cwd = workdir(tmp_path, teacher)
    for part in ("data/centroids", "models/direct-cast"):
        shutil.copytree(chain / part, cwd / part)
    proc = run_stage(cwd, "pack_safetensors.py", "--format", "s3d8", "--methods", "direct-cast", check=False)
    assert proc.returncode != 0 and "--out" in proc.stderr, proc.stderr
    proc = run_stage(cwd, "pack_safetensors.py", "--format", "s3d8", "--methods", "direct-cast", "--out", "dc")
    assert json.loads(proc.stdout[proc.stdout.index("{"):])["direct-cast"]["bits_per_weight_whole"] > 0
    assert sorted(p.name for p in (cwd / "dc/s3d8").iterdir()) == ["direct-cast"]
    assert not (cwd / "models/packed").exists() and not (cwd / "reports/pack").exists()
    ours, stage = cwd / "dc/s3d8/direct-cast", chain / "models/packed/s3d8/direct-cast"
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in stage.iterdir())
    for f in stage.iterdir():
        assert (ours / f.name).read_bytes() == f.read_bytes(), f.name
    proc = run_stage(cwd, "pack_safetensors.py", "--format", "s3d8", "--methods", "qat,dc", "--out", "x", check=False)
    assert proc.returncode != 0 and "methods" in proc.stderr, proc.stderr


def test_a_precision_plan_and_the_sequential_cast_through_the_stages(chain, tmp_path, teacher):
    """calibrate.sequential (the teacher's answers as calibration) and pack.precision (the token embedding and the
    down projections INT8) through direct-cast, qat-train (learned scales on every format) and pack-safetensors:
    each packed weight in its planned format, the direct cast's INT8 weights are INT8's own absmax cast, the QAT
    student's decode to its fake-quant forward, and the packed models load."""
    import torch

    from pipeline import formats
    from pipeline.packed.checkpoint import CheckpointReader
    from pipeline.packed.file import load_packed_model, read_metadata

    rules = {r"embed_tokens$": "int8", r"mlp\.down_proj$": "int8"}
    cwd = workdir(tmp_path, teacher, **{"calibrate.sequential": True, "pack.precision": rules, "qat.init": "ptq",
                                        "qat.learn_scales": True})
    for part in ("data/teacher", "data/centroids", "data/calibration"):
        shutil.copytree(chain / part, cwd / part)
    for stage in ("direct_cast.py", "qat_train.py", "pack_safetensors.py"):
        run_stage(cwd, stage, "--format", "s3d8")
    int8, teacher_w = formats.get("int8"), CheckpointReader(teacher)
    for method in ("direct-cast", "qat"):
        file = cwd / f"models/packed/s3d8/{method}/model.safetensors"
        planned = json.loads(read_metadata(file)["formats"])
        assert planned and set(planned.values()) == {"int8"}
        assert any("embed_tokens" in k for k in planned) and all(k.endswith(("embed_tokens.weight",
                                                                              "down_proj.weight")) for k in planned)
        packed = safe_open(str(file), "pt")
        for name in planned:
            tensors = {s: packed.get_tensor(f"{name}.{s}") for s in int8.suffixes}
            w = teacher_w.get(name).float()
            if method == "direct-cast":
                assert torch.equal(int8.unpack(tensors, tuple(w.shape)), int8.quantize(w, {})), name
        load_packed_model(file)
    config = json.loads((cwd / "models/packed/s3d8/qat/config.json").read_text())
    assert config["quantization_config"]["formats"] == planned


def test_every_stage_has_help_without_side_effects(tmp_path):
    for script in sorted(STAGES.glob("*.py")):
        if script.name == "__init__.py":
            continue
        proc = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0 and "usage:" in proc.stdout, (script.name, proc.stderr[-500:])
        assert not any(tmp_path.iterdir()), f"{script.name} --help wrote {list(tmp_path.iterdir())}"


def test_missing_teacher_is_named(tmp_path, teacher):
    cwd = workdir(tmp_path, tmp_path / "no-such-teacher")
    proc = run_stage(cwd, "fit_centroids.py", "--format", "s3d8", check=False)
    assert proc.returncode == 1 and "no-such-teacher" in proc.stderr


def test_contradictory_params_are_named(chain, tmp_path, teacher):
    cwd = workdir(tmp_path, teacher, **{"qat.batch_size": 64})
    for part in ("data/teacher", "data/centroids", "data/calibration", "models/direct-cast"):
        shutil.copytree(chain / part, cwd / part)
    proc = run_stage(cwd, "qat_train.py", "--format", "s3d8", check=False)
    assert proc.returncode == 1 and "qat.batch_size=64" in proc.stderr
    proc = run_stage(cwd, "qat_train.py", "--format", "int", check=False)
    assert proc.returncode == 1 and "data/centroids/int.safetensors" in proc.stderr
    doc = yaml.safe_load((cwd / "params.yaml").read_text())
    doc["qat"]["stepz"] = 3
    (cwd / "params.yaml").write_text(yaml.safe_dump(doc))
    proc = run_stage(cwd, "qat_train.py", "--format", "s3d8", check=False)
    assert proc.returncode == 1 and "qat.stepz" in proc.stderr


def test_corrupt_shard_is_named(chain, tmp_path, teacher):
    cwd = workdir(tmp_path, teacher)
    for part in ("data/teacher", "data/centroids", "data/calibration", "models/direct-cast"):
        shutil.copytree(chain / part, cwd / part)
    victim = cwd / "data/teacher/shard-00002.parquet"
    victim.write_bytes(victim.read_bytes()[:100])
    proc = run_stage(cwd, "qat_train.py", "--format", "s3d8", check=False)
    assert proc.returncode == 1 and "shard-00002.parquet" in proc.stderr


def _outputs(root: Path) -> dict[str, str]:
    """sha256 of every file the DVC outputs hold (data, models, reports), as DVC would hash them."""
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for top in ("data", "models", "reports") for p in sorted((root / top).rglob("*"))
            if p.is_file() and not p.is_symlink()}


def test_every_output_is_byte_reproducible(chain, tmp_path, teacher):
    cwd = workdir(tmp_path, teacher)
    for script, *args in CHAIN:
        run_stage(cwd, script, *args)
    first, second = _outputs(chain), _outputs(cwd)
    assert first.keys() == second.keys()
    assert [k for k in first if first[k] != second[k]] == []


@pytest.mark.parametrize("stage, function, calls", [
    (("fit_centroids.py", "--format", "s3d8"), "pipeline.packed.safetensors_io:StreamingWriter.write", 3),
    (("sample_prompts.py",), "pipeline.files.shards.write_shard", 1),
    (("pack_safetensors.py", "--format", "s3d8"), "pipeline.packed.safetensors_io:StreamingWriter.write", 5),
])
def test_a_kill_inside_a_write_leaves_nothing_and_a_rerun_gives_the_same_outputs(chain, tmp_path, teacher,
                                                                               stage, function, calls):
    cwd = workdir(tmp_path, teacher)
    for part in ("data/centroids", "data/calibration", "data/sampled", "data/teacher", "models/direct-cast",
                 "models/qat"):
        if (chain / part).exists() and stage[0] not in ("sample_prompts.py",):
            shutil.copytree(chain / part, cwd / part)
    run_stage_killed_after(cwd, function, *stage, calls=calls)
    run_stage(cwd, *stage)
    debris = [p for top in ("data", "models", "reports") for p in (cwd / top).rglob(".*") if "prompts" not in p.parts]
    assert debris == [], debris
    ref, now = _outputs(chain), _outputs(cwd)
    assert [k for k in now if k in ref and now[k] != ref[k]] == []


def test_direct_cast_resumes_after_a_kill_with_the_same_result(chain, tmp_path, teacher):
    cwd = workdir(tmp_path, teacher)
    for part in ("data/centroids", "data/calibration"):
        shutil.copytree(chain / part, cwd / part)
    run_stage_killed_after(cwd, "pipeline.cast.direct.cast_group", "direct_cast.py", "--format", "s3d8")
    assert not (cwd / "models/direct-cast").exists()          # the DVC output appears only whole
    done = list((cwd / "checkpoints/direct-cast/s3d8").glob("*.safetensors"))
    assert len(done) == 1
    log = run_stage(cwd, "direct_cast.py", "--format", "s3d8").stderr
    assert "resuming, 1 of" in log
    ref = chain / "models/direct-cast/s3d8"
    assert sorted(p.name for p in (cwd / "models/direct-cast/s3d8").iterdir()) == sorted(p.name for p in ref.iterdir())
    for f in ref.iterdir():
        assert (cwd / "models/direct-cast/s3d8" / f.name).read_bytes() == f.read_bytes(), f.name
    assert not (cwd / "checkpoints/direct-cast/s3d8").exists()


def test_direct_cast_is_ptq_bit_for_bit_and_what_pack_and_qat_read(chain, teacher):
    """The stage's files hold what ptq.pack writes and ptq.start starts QAT from (fitting the table afresh, as
    both did before the stage existed), and the packed direct cast is those tensors."""
    import torch

    from pipeline import formats
    from pipeline.cast import ptq
    from pipeline.cast.calibrate import Calibration
    from pipeline.packed.checkpoint import CheckpointReader
    from pipeline.cast.direct import DirectCast

    fmt = formats.get("s3d8")
    cast = DirectCast(chain / "models/direct-cast/s3d8", fmt, "gptq")
    hessians = Calibration(str(chain / "data/calibration/hessians.safetensors"))
    teacher_w = CheckpointReader(teacher)
    packed = safe_open(str(chain / "models/packed/s3d8/direct-cast/model.safetensors"), "pt")
    assert len(cast.weight_map) > 10
    for name in cast.weight_map:
        w = teacher_w.get(f"{name}.weight").float()
        want = ptq.pack(fmt, w, algorithm="gptq", hessian=hessians.get(name))
        got = cast.packed(name, w.shape)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), name
        assert all(torch.equal(packed.get_tensor(f"{name}.weight.{k}"), got[k]) for k in fmt.suffixes), name
        master, state, scale = ptq.start(fmt, w, algorithm="gptq", hessian=hessians.get(name))
        m2, s2, sc2 = cast.start(name, w)
        assert torch.equal(master, m2) and torch.equal(scale, sc2) and torch.equal(state["table"], s2["table"]), name
    with pytest.raises(ValueError, match="pack.algorithm is 'search'"):
        DirectCast(chain / "models/direct-cast/s3d8", fmt, "search")
    with pytest.raises(ValueError, match="not 'int'"):
        DirectCast(chain / "models/direct-cast/s3d8", formats.get("int"), "gptq")


def test_direct_cast_deals_files_to_processes():
    from pipeline.cast.direct import deal, group_of

    assert group_of("model.layers.12.mlp.down_proj") == "model.layers.12"
    assert group_of("model.vision_model.transformer.layers.3.self_attn.q_proj") == \
        "model.vision_model.transformer.layers.3"
    assert group_of("lm_head") == group_of("model.embed_tokens") == "rest"
    costs = {"a": 8.0, "b": 5.0, "c": 4.0, "d": 3.0, "e": 1.0}
    assert deal(costs, 1) == [["a", "b", "c", "d", "e"]]
    assert deal(costs, 2) == [["a", "d"], ["b", "c", "e"]]
    assert sorted(sum(deal(costs, 3), [])) == sorted(costs)


def test_calibrate_in_several_passes_writes_the_same_file(chain, tmp_path, teacher):
    """calibrate.hessian_memory_gb below one matrix's float64 sums: a pass over the prompts per matrix, the same
    bytes as one pass."""
    from pipeline.cast.calibrate import passes

    assert passes([4, 4, 8, 2], 8 * (16 + 16) + 8 * 16) == [(0, 2), (2, 3), (3, 4)]   # two sums + one product
    assert passes([100], 1.0) == [(0, 1)] and passes([], 1.0) == []
    cwd = workdir(tmp_path, teacher, **{"calibrate.hessian_memory_gb": 1e-9})
    shutil.copytree(chain / "data/teacher", cwd / "data/teacher")
    log = run_stage(cwd, "calibrate.py").stderr
    modules = int(safe_open(str(cwd / "data/calibration/hessians.safetensors"), "pt").metadata()["modules"])
    assert f"{modules} pass(es)" in log
    assert (cwd / "data/calibration/hessians.safetensors").read_bytes() == \
        (chain / "data/calibration/hessians.safetensors").read_bytes()


@pytest.mark.slow            # the chain again (minutes); test_cpu_numerics checks every stage imports the pin
def test_every_stage_writes_the_same_bytes_on_an_avx2_cpus_code_path(chain, tmp_path, teacher):
    """The chain again with an AVX2-only CPU's code path forced (torch's ATen, MKL and oneDNN at AVX2, the native
    kernels' avx2 variant): every output, byte for byte, as on this CPU's own (pipeline/cpu_numerics.py)."""
    from tests.test_cpu_numerics import AVX2_CPU, needs_avx512
    if needs_avx512.args[0]:
        pytest.skip(needs_avx512.kwargs["reason"])
    cwd = workdir(tmp_path, teacher)
    for script, *args in CHAIN:
        run_stage(cwd, script, *args, env=AVX2_CPU)
    ours, reference = _outputs(cwd), _outputs(chain)
    assert set(ours) == set(reference)
    differ = [name for name in reference if ours[name] != reference[name]]
    assert not differ, f"outputs that depend on the CPU's code path: {differ}"
