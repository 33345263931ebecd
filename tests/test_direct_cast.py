"""Stage direct-cast's resume: its fingerprint covers what determines the bytes (the teacher's weights, the
calibration, the casting code), the large files are hashed once per (path, size, mtime), and a crash during the
final move keeps every finished file."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.stage_helpers import build_tiny_teacher, run_stage, run_stage_killed_after, workdir


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The stages before direct-cast and direct-cast itself, uninterrupted."""
    root = tmp_path_factory.mktemp("cast")
    cwd = workdir(root / "ref", build_tiny_teacher(root / "teacher"))
    for script, *args in [("fit_centroids.py", "--format", "s3d8"), ("sample_prompts.py",), ("teacher_generate.py",),
                          ("calibrate.py",), ("direct_cast.py", "--format", "s3d8")]:
        run_stage(cwd, script, *args)
    return cwd, root / "teacher"


def test_a_crash_in_the_final_move_keeps_every_finished_file(reference, tmp_path):
    ref, teacher = reference
    cwd = workdir(tmp_path, teacher)
    for part in ("data/centroids", "data/calibration", "data/teacher"):
        shutil.copytree(ref / part, cwd / part)
    run_stage_killed_after(cwd, "os.link", "direct_cast.py", "--format", "s3d8")     # the first file moved
    staged = sorted(p.name for p in (cwd / "checkpoints/direct-cast/s3d8").glob("*.safetensors"))
    out = ref / "models/direct-cast/s3d8"
    assert staged == sorted(p.name for p in out.glob("*.safetensors"))
    log = run_stage(cwd, "direct_cast.py", "--format", "s3d8").stderr
    assert f"resuming, {len(staged)} of {len(staged)} files done" in log
    assert {p.name: p.read_bytes() for p in (cwd / "models/direct-cast/s3d8").iterdir()} == \
        {p.name: p.read_bytes() for p in out.iterdir()}


def test_the_fingerprint_covers_weights_calibration_and_code(reference, tmp_path, monkeypatch):
    from pipeline.cast.direct import cast_fingerprint, code_files

    ref, teacher = reference
    monkeypatch.chdir(tmp_path)
    shutil.copytree(teacher, tmp_path / "teacher")
    weights = next((tmp_path / "teacher").glob("*.safetensors"))
    calibration = str(ref / "data/calibration/hessians.safetensors")
    code = [tmp_path / "cast.py"]
    code[0].write_text("# the casting code\n")
    first = cast_fingerprint(["s3d8"], tmp_path / "teacher", calibration, code)
    assert cast_fingerprint(["s3d8"], tmp_path / "teacher", None, code) != first
    assert cast_fingerprint(["int"], tmp_path / "teacher", calibration, code) != first
    code[0].write_text("# the casting code, changed\n")
    assert cast_fingerprint(["s3d8"], tmp_path / "teacher", calibration, code) != first
    code[0].write_text("# the casting code\n")
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 1                                          # a weight's last byte: the same size, other bytes
    weights.write_bytes(bytes(blob))
    assert cast_fingerprint(["s3d8"], tmp_path / "teacher", calibration, code) != first
    assert all(f.is_file() for f in code_files()) and any(f.suffix == ".c" for f in code_files())


def test_large_files_are_hashed_once_per_size_and_mtime(tmp_path, monkeypatch):
    from pipeline.files import hashes as filehash

    data = tmp_path / "hessians.safetensors"
    data.write_bytes(b"x" * 1000)
    reads = []
    real = filehash.file_hash
    monkeypatch.setattr(filehash, "file_hash", lambda p: (reads.append(p), real(p))[1])
    cache = tmp_path / "hashes.json"
    first = filehash.cached_file_hash(data, cache)
    assert filehash.cached_file_hash(data, cache) == first and len(reads) == 1
    data.write_bytes(b"y" * 1000)
    os.utime(data, ns=(1, 1))
    assert filehash.cached_file_hash(data, cache) != first and len(reads) == 2


def test_the_fingerprint_lies_beside_the_group_file_not_in_it(tmp_path):
    """The output's bytes depend on the tensors alone: a run whose fingerprint changed (a code edit) but whose cast
    did not writes the same files, so the stages after direct-cast stay cached."""
    import torch
    from safetensors import safe_open

    from pipeline.cast.direct import finished, write_group

    path = tmp_path / "rest.safetensors"
    tensors = {"a.weight.packed": torch.arange(6, dtype=torch.uint8)}
    write_group(path, tensors, {"format": "s3d8", "algorithm": "gptq"}, "fp-1")
    first = path.read_bytes()
    assert finished(path, "fp-1") and not finished(path, "fp-2")
    with safe_open(str(path), "pt") as f:
        assert "fingerprint" not in (f.metadata() or {})
    write_group(path, tensors, {"format": "s3d8", "algorithm": "gptq"}, "fp-2")
    assert path.read_bytes() == first and finished(path, "fp-2")
    path.with_suffix(".fingerprint").unlink()
    assert not finished(path, "fp-2")                  # a file without its mark (a crash between the two) is redone
    path.with_suffix(".fingerprint").write_text("fp-2")
    path.write_bytes(first[:20])
    assert not finished(path, "fp-2")                  # a damaged file is redone
