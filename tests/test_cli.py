"""The ``s3d8`` command as a user meets it (issue 23, items 4 and 5): ``s3d8 generate`` gives Hugging Face
``generate``'s tokens on the toy teacher packed (with an image and without, the stop token not printed), one-line
errors with exit status 1 for bad files and values, argparse's 2 for command lines it cannot parse, one meaning of
``--threads``, help text on every option, ``--help`` that runs nothing, and a NaN weight named by pack-safetensors."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline import cli


from pipeline.runtime import generation as runtime
REPO = Path(__file__).resolve().parents[1]
TOY_TEACHER = REPO / "data" / "toy-teacher"


@pytest.fixture(scope="module")
def toy_packed(tmp_path_factory):
    """The toy teacher (data/toy-teacher) packed in S3D8 as pack-safetensors lays it out. One centroid table
    fitted on a small sample serves every weight: a fit per weight takes half a minute here."""
    from pipeline import formats
    from pipeline.packed.checkpoint import CheckpointReader
    from pipeline.formats.s3d8 import fit_centroids
    from pipeline.hf.write import write_model_dir
    from pipeline.models import load_config, meta_model, quantised_weight_names

    reader = CheckpointReader(TOY_TEACHER)
    config = load_config(str(TOY_TEACHER))
    names = list(quantised_weight_names(meta_model(config)).values())
    sample = next(n for n in names if "mlp.up_proj" in n)
    table = fit_centroids(reader.get(sample).float(), seed=0, max_vectors=4096)
    out = tmp_path_factory.mktemp("toy-packed") / "s3d8"
    write_model_dir(out, reader, formats.get("s3d8"), {n.removesuffix(".weight"): {"table": table} for n in names},
                    teacher_dir=TOY_TEACHER, method="direct-cast", base_model=str(TOY_TEACHER),
                    teacher_name="toy-mllama", metadata={"config": config.to_dict(), "method": "direct-cast",
                                                         "source_model": str(TOY_TEACHER)})
    return out


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    from pipeline.toy.tasks import heldout_examples

    root = tmp_path_factory.mktemp("images")
    out = []
    for task in ("toy-vqa", "toy-chartqa"):
        image, question, _ = heldout_examples(task, 1)[0]
        image.save(root / f"{task}.png")
        out.append((root / f"{task}.png", question))
    return out


def hf_reference(model_dir: Path, prompt: str, image: Path | None, max_new_tokens: int):
    """``(input ids, generated tokens up to and without the stop token, stopped)`` of Hugging Face ``generate``,
    greedy, on the packed model loaded through the runtime's path, the prompt built as eval builds it."""
    from PIL import Image

    from pipeline.chat import chat_prompt
    from pipeline.runtime.generation import eos_ids
    from pipeline.models import load_processor

    processor = load_processor(str(model_dir))
    if image is None:
        text = processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": prompt}]}],
                                             add_generation_prompt=True, tokenize=False)
        inputs = processor(text=[text], add_special_tokens=False, return_tensors="pt")
    else:
        inputs = processor(images=[Image.open(image).convert("RGB")], text=[chat_prompt(processor, prompt)],
                           add_special_tokens=False, return_tensors="pt")
    model = runtime.load(model_dir / "model.safetensors")
    stop = eos_ids(model, processor)
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=sorted(stop),
                             pad_token_id=processor.tokenizer.pad_token_id)
    generated = out[0, inputs["input_ids"].shape[1]:].tolist()
    end = next((i for i, t in enumerate(generated) if t in stop), None)
    return inputs["input_ids"], generated[:end], end is not None, processor


@pytest.mark.parametrize("impl", ["lean", "hf"])
@pytest.mark.parametrize("case", ["vqa", "chartqa", "text"])
def test_generate_gives_hf_generate_tokens(toy_packed, examples, capsys, case, impl):
    image, prompt = {"vqa": examples[0], "chartqa": examples[1], "text": (None, "Describe a red square.")}[case]
    ids, want, stopped, processor = hf_reference(toy_packed, prompt, image, 24)
    assert (ids[0] == processor.tokenizer.bos_token_id).sum() == 1, "one BOS, as eval and teacher-generate give"
    # the runtime's prompt is the same ids (the CLI once fed two BOS tokens with an image)
    from pipeline.runtime.generation import _inputs, processor_for
    from pipeline.runtime.models import read_header

    file = toy_packed / "model.safetensors"
    got, _ = _inputs("mllama", processor_for(file, read_header(file)[1], None), prompt,
                     None if image is None else str(image), 0)
    assert torch.equal(got["input_ids"], ids)
    args = ["generate", str(toy_packed), "--prompt", prompt, "--max-new-tokens", "24", "--threads", "1",
            "--impl", impl, *(["--image", str(image)] if image else [])]
    capsys.readouterr()
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    # the text printed is the decoded tokens of HF generate, without the stop token
    assert out == processor.tokenizer.decode(want, skip_special_tokens=True) + "\n"
    assert "<|eot_id|>" not in out and "<|end_of_text|>" not in out
    if case == "vqa":
        assert stopped and want, "the toy teacher answers and stops: the stop token was there to (not) print"


def test_stop_token_is_not_printed_and_split_characters_print_whole():
    import io

    text = bytes([0xC3, 0xA9]).decode()          # é, split over two byte tokens
    decode = lambda tokens: bytes(tokens).decode(errors="replace")  # noqa: E731
    buf = io.StringIO()
    stream = runtime.TextStream(decode, stop={0}, out=buf)
    for t in (ord("a"), 0xC3):
        stream(t)
    assert buf.getvalue() == "a", "half a character waits"
    stream(0xA9)
    stream(0)
    stream.close()
    assert buf.getvalue() == "a" + text + "\n"


# --- errors ------------------------------------------------------------------------------------------------------


def _one_line_error(capsys, argv, needle, status=1):
    capsys.readouterr()
    assert cli.main(argv) == status, argv
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], (argv, err)


def _corrupt_copies(toy_packed: Path, root: Path) -> dict[str, Path]:
    data = (toy_packed / "model.safetensors").read_bytes()
    out = {}
    for name, blob in {"truncated": data[: len(data) // 2], "empty": b"", "header-only": data[:1000],
                       "garbled-header": data[:8] + b"\xff" * 64 + data[72:],
                       "longer": data + b"\0" * 16}.items():
        d = root / name
        shutil.copytree(toy_packed, d)
        (d / "model.safetensors").write_bytes(blob)
        out[name] = d
    return out


def test_a_corrupt_model_file_is_one_line_naming_it(toy_packed, tmp_path, capsys):
    for name, d in _corrupt_copies(toy_packed, tmp_path).items():
        _one_line_error(capsys, ["generate", str(d), "--prompt", "hi", "--threads", "1"], str(d / "model.safetensors"))
        _one_line_error(capsys, ["eval", str(d), "--n", "1", "--tasks", "toy-vqa"], str(d / "model.safetensors"))
    # the same through the processes a user starts
    d = tmp_path / "truncated"
    for argv in ([sys.executable, "-m", "pipeline.runtime.generation", str(d), "--prompt", "hi"],
                 [sys.executable, "-m", "pipeline.cli", "generate", str(d), "--prompt", "hi"]):
        p = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 1 and len(lines) == 1, p.stderr
        assert "model.safetensors: truncated or corrupt" in lines[0] and "Traceback" not in p.stderr


def test_values_out_of_range_are_errors_with_status_1(toy_packed, capsys):
    cpus = runtime.available_cpus()
    model = str(toy_packed)
    for argv, needle in [
        (["eval", model, "--n", "0"], "--n 0: must be at least 1"),
        (["eval", model, "--batch-size", "0"], "--batch-size 0"),
        (["eval", model, "--max-new-tokens", "0"], "--max-new-tokens 0"),
        (["eval", model, "--threads", "-1"], "--threads -1"),
        (["eval", model, "--threads", str(cpus + 1)], f"--threads {cpus + 1}"),
        (["bench", "--threads", "999"], "--threads 999: use 0 (torch's default) or 1.."),
        (["bench", "--threads", "-1"], "--threads -1"),
        (["bench", "--seconds", "-1"], "--seconds -1"),
        (["generate", model, "--prompt", "x", "--threads", "-1"], "--threads -1"),
        (["generate", model, "--prompt", "x", "--threads", "999"], "--threads 999"),
        (["generate", model, "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens 0"),
    ]:
        _one_line_error(capsys, argv, needle)


def test_command_lines_argparse_cannot_parse_are_status_2(capsys):
    for argv in (["bench", "--threads", "x"], ["eval"], ["generate", "m"], ["generate", "m", "--prompt", "x",
                                                                          "--threads", "two"], ["nonsense"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2, argv
        assert "usage: s3d8" in capsys.readouterr().err


def test_threads_zero_is_torchs_default_everywhere(capsys):
    torch.set_num_threads(1)
    assert runtime.check_threads(0) == torch.get_num_threads() == 1, "0 leaves the count as it is"
    assert cli.main(["bench", "--threads", "0", "--shape", "1,48,48", "--seconds", "0"]) == 0
    assert "threads=1" in capsys.readouterr().out
    assert cli.build_parser().parse_args(["eval", "m"]).threads == 0
    assert cli.build_parser().parse_args(["bench"]).threads == 1, "bench times one thread unless told"
    assert runtime.build_parser().parse_args(["m", "--prompt", "x"]).threads == 0


def _parsers():
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    out = {f"s3d8 {name}": p for name, p in subs.choices.items() if name != "generate"}
    out["s3d8 generate"] = runtime.build_parser("s3d8 generate")
    out["s3d8"] = parser
    return out


def test_every_option_has_help():
    for prog, parser in _parsers().items():
        for action in parser._actions:
            if action.__class__.__name__ == "_SubParsersAction":
                continue
            assert action.help, f"{prog} {'/'.join(action.option_strings) or action.dest}: no help text"


def test_help_runs_nothing_and_names_the_command(tmp_path, capsys):
    for command in ("pack", "eval", "export-sqt", "bench", "generate"):
        out = tmp_path / command
        with pytest.raises(SystemExit) as e:
            cli.main([command, str(tmp_path / "missing"), str(out), "--help"] if command != "bench"
                     else [command, "--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        assert text.startswith(f"usage: s3d8 {command}"), text[:80]
        assert not out.exists()
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    text = capsys.readouterr().out
    assert "s3d8 generate" in text and "python -m pipeline.runtime" not in text
    assert "exit status" in text.lower()


# --- pack-safetensors of a student with a NaN weight ----------------------------------------------------------


def test_pack_safetensors_names_a_nan_weight_and_its_file(tmp_path):
    from safetensors.torch import load_file, save_file

    from pipeline import formats
    from pipeline.packed.checkpoint import CheckpointReader
    from pipeline.formats.s3d8 import fit_centroids
    from pipeline.models import load_config, meta_model, quantised_weight_names
    from tests.stage_helpers import build_tiny_teacher, run_stage, workdir

    teacher = build_tiny_teacher(tmp_path / "teacher")
    cwd = workdir(tmp_path / "work", teacher, **{"pack.algorithm": "absmax"})
    names = list(quantised_weight_names(meta_model(load_config(str(teacher)))).values())
    reader = CheckpointReader(teacher)
    table = fit_centroids(reader.get(names[-1]).float(), seed=0, max_vectors=1024)
    fmt = formats.get("s3d8")
    (cwd / "data" / "centroids").mkdir(parents=True)
    fmt.save_states(cwd / "data" / "centroids" / "s3d8.safetensors", {n.removesuffix(".weight"): {"table": table}
                                                                      for n in names})
    student = cwd / "models" / "qat" / "s3d8"
    student.mkdir(parents=True)
    tensors = load_file(str(teacher / "model.safetensors"))
    bad = next(n for n in names if "layers.0.mlp.up_proj" in n)
    tensors[bad][5, 7] = float("nan")
    save_file(tensors, str(student / "model.safetensors"))
    save_file({}, str(student / "qat_state.safetensors"), metadata={"format": "s3d8"})
    run_stage(cwd, "direct_cast.py", "--format", "s3d8")
    p = run_stage(cwd, "pack_safetensors.py", "--format", "s3d8", check=False)
    assert p.returncode == 1
    assert (f"models/qat/s3d8/model.safetensors: tensor {bad}: contains NaN or Inf (first at index [5, 7])"
            in p.stderr.strip().splitlines()[-1]), p.stderr
