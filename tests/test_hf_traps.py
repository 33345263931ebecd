"""The user's path through Hugging Face without traps (issue 23): `s3d8 pack` writes the same directory as
pack-safetensors; packed tensors without their quantizer are an error, never random weights (every combination
of plain transformers / pipeline imported x config good / misspelled / missing x model_type guard / mllama);
save_pretrained of a loaded packed model writes the same packed bytes back; the refusal without the project
says where to find it; a packed text-only Llama loads through the generic guard."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pipeline  # noqa: F401  (registers the packed formats with transformers)
from pipeline import formats
from pipeline.packed.checkpoint import CheckpointReader
from pipeline.hf.quantizer import PackedQuantConfig
from pipeline.hf.config import HINT_KEY, INDEX_NAME, INSTALL, MODEL_TYPE, guard_model_type
from pipeline.hf.write import write_model_dir
from pipeline.packed.file import load_packed_model, read_metadata
from tests.test_hf import SHARD_LIMIT, from_pretrained, inputs, packed, teacher, write  # noqa: F401  (the fixtures)


def logits(model, config=None) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs(config or model.config)).logits


# --- 1a: s3d8 pack OUT_DIR --------------------------------------------------------------------------------

def test_cli_pack_writes_the_hugging_face_directory(teacher, tmp_path, capsys):
    from pipeline.cli import main

    out = tmp_path / "packed"
    assert main(["pack", str(teacher), str(out)]) == 0
    assert {"config.json", "README.md", "generation_config.json", "model.safetensors", "processor_config.json",
            "tokenizer.json"} <= {p.name for p in out.iterdir()}
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == MODEL_TYPE and config["quantization_config"]["quant_method"] == "s3d8"
    model = from_pretrained(out, dtype=torch.float32, quantization_config=PackedQuantConfig(kernel="torch"))
    assert torch.equal(logits(model), logits(load_packed_model(out / "model.safetensors")))
    assert read_metadata(out / "model.safetensors")["method"] == "direct-cast"

    assert main(["pack", str(teacher), str(out)]) == 0           # a packed directory is replaced whole
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert main(["pack", str(teacher), str(other)]) == 1
    assert "is not a packed model directory" in capsys.readouterr().err and (other / "notes.txt").exists()
    assert main(["pack", str(teacher), str(teacher)]) == 1
    assert "would replace the model it packs" in capsys.readouterr().err
    assert main(["pack", str(teacher), str(tmp_path / "alone.safetensors"), "--act-order"]) == 0   # a file stays
    assert read_metadata(tmp_path / "alone.safetensors")["format"] == "s3d8"                          # a file
    assert [json.loads(read_metadata(f)["pack_command"])["act_order"]
            for f in (out / "model.safetensors", tmp_path / "alone.safetensors")] == [False, True]


# --- 1b: every combination of config and transformers -----------------------------------------------------

def variant(packed: Path, tmp_path: Path, fmt: str, model_type: str, qc: str) -> Path:
    d = shutil.copytree(packed / fmt, tmp_path / f"{fmt}-{model_type}-{qc}")
    config = json.loads((d / "config.json").read_text())
    config["model_type"] = model_type
    if qc == "misspelled":
        config["quantization_config"]["quant_method"] = "s3d9"
    elif qc == "missing":
        del config["quantization_config"]
    (d / "config.json").write_text(json.dumps(config))
    return d


MODEL_TYPES = [MODEL_TYPE, "mllama"]
CONFIGS = ["good", "misspelled", "missing"]


@pytest.mark.parametrize("fmt", ["s3d8", "int"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("qc", CONFIGS)
def test_pipeline_imported_never_loads_random_weights(packed, tmp_path, fmt, model_type, qc):
    d = variant(packed, tmp_path, fmt, model_type, qc)
    if qc == "good":
        model = from_pretrained(d, dtype=torch.float32, quantization_config=PackedQuantConfig(kernel="torch"))
        reference = load_packed_model(packed / "s3d8" / "model.safetensors" if fmt == "s3d8" else packed / fmt)
        assert torch.equal(logits(model), logits(reference))
        return
    problem = "has no quantization_config" if qc == "missing" else "quantization_config.quant_method 's3d9'"
    method = "s3d8" if fmt == "s3d8" else "s3d8-pipeline-int"
    with pytest.raises(ValueError, match=rf"holds weights packed by s3d8-pipeline .*{problem}.*random weights.*"
                                         rf"\"quant_method\": \"{method}\", \"format\": \"{fmt}\""):
        from_pretrained(d)
    if qc == "missing":        # the quantization config passed instead: it loads packed directories only
        with pytest.raises(ValueError, match=r"PackedQuantConfig loads packed directories.*s3d8 pack"):
            from_pretrained(d, quantization_config=PackedQuantConfig(format=fmt))


def test_packed_tensor_names_alone_are_refused(packed, tmp_path):
    """A packed file whose metadata lost its 'format' is still recognised by its tensor names."""
    from safetensors.torch import load_file, save_file

    d = variant(packed, tmp_path, "s3d8", "mllama", "missing")
    tensors = load_file(d / "model.safetensors")
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensor '[\w.]+\.weight\.(packed|scale|table)'.*has no quantization_config"):
        from_pretrained(d)


PLAIN = """
import sys
from transformers import AutoModelForImageTextToText
for d in sys.argv[1:]:
    try:
        AutoModelForImageTextToText.from_pretrained(d)
        print(d, "LOADED")
    except ValueError as e:
        print(d, "REFUSED", str(e).replace(chr(10), " "))
print("pipeline" in sys.modules)
"""


def test_plain_transformers_every_combination(packed, tmp_path):
    """Without the project, the guard model_type refuses whatever the quantization_config says, with the
    project's name in the message. A config edited back to model_type mllama is the one case no code of ours
    runs in: transformers then warns and loads random weights (why the guard is there)."""
    dirs = {(mt, qc): variant(packed, tmp_path, "s3d8", mt, qc) for mt in MODEL_TYPES for qc in CONFIGS}
    proc = subprocess.run([sys.executable, "-c", PLAIN, *map(str, dirs.values())], cwd=tmp_path,
                          capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "False"
    for (mt, qc), d in dirs.items():
        (line,) = [line for line in lines if line.startswith(f"{d} ")]
        if mt == MODEL_TYPE:
            assert f"REFUSED The checkpoint you are trying to load has model type `{MODEL_TYPE}`" in line, line
            assert "s3d8-pipeline" in line
        else:
            assert line.endswith("LOADED"), line


# --- 2: save_pretrained -----------------------------------------------------------------------------------

@pytest.mark.parametrize("options", [{}, {"kernel": "torch"}, {"kernel": "torch", "act_quant": False}])
def test_save_pretrained_keeps_the_packed_bytes(packed, tmp_path, options):
    source = packed / "s3d8"
    quantization = {"quantization_config": PackedQuantConfig(**options)} if options else {}
    model = from_pretrained(source, dtype=torch.float32, **quantization)
    before = logits(model)
    model.save_pretrained(tmp_path / "saved")
    saved = tmp_path / "saved"
    assert (saved / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
    config = json.loads((saved / "config.json").read_text())
    assert config["model_type"] == MODEL_TYPE
    assert config["quantization_config"] == json.loads((source / "config.json").read_text())["quantization_config"]
    assert HINT_KEY in config and INSTALL in (saved / "README.md").read_text()
    again = from_pretrained(saved, dtype=torch.float32, **quantization)
    assert torch.equal(logits(again), before)
    assert again.config.quantization_config.kernel == options.get("kernel", "auto")


def test_save_pretrained_sharded_and_refusals(packed, tmp_path):
    model = from_pretrained(packed / "int", dtype=torch.float32)
    model.save_pretrained(tmp_path / "one")
    assert {p.name for p in (tmp_path / "one").glob("*.safetensors")} == {"model.safetensors"}
    model.save_pretrained(tmp_path / "one", max_shard_size=SHARD_LIMIT)   # replaces the single file by shards
    assert not (tmp_path / "one" / "model.safetensors").exists() and (tmp_path / "one" / INDEX_NAME).exists()
    assert torch.equal(logits(from_pretrained(tmp_path / "one", dtype=torch.float32)), logits(model))

    eager = from_pretrained(packed / "s3d8", quantization_config=PackedQuantConfig(kernel="torch", decode="eager"))
    with pytest.raises(ValueError, match=r"holds its decoded weight, not the packed bytes.*decode='lazy'"):
        eager.save_pretrained(tmp_path / "eager")
    with pytest.raises(ValueError, match=r"push_to_hub=True is not supported.*upload_folder"):
        model.save_pretrained(tmp_path / "hub", push_to_hub=True)
    with pytest.raises(ValueError, match=r"option\(s\) \['state_dict'\] are not supported"):
        model.save_pretrained(tmp_path / "sd", state_dict={})
    assert not (tmp_path / "eager").exists() or not any((tmp_path / "eager").iterdir())


# --- 3: the saved quantization config ---------------------------------------------------------------------

def test_loading_options_never_reach_a_saved_config(packed):
    model = from_pretrained(packed / "s3d8", quantization_config=PackedQuantConfig(kernel="torch", decode="eager",
                                                                                    act_quant=False))
    saved = model.config.to_dict()["quantization_config"]
    assert set(saved) == {"quant_method", "format", "layout", "version", "bits_per_weight", "modules_to_not_convert"}
    assert "kernel" not in model.config.to_json_string()
    old = {"quant_method": "s3d8", "format": "s3d8", "format_version": "1", "layout": "llama-mobile-s3d8-packed-v1"}
    assert PackedQuantConfig(**old).to_dict()["version"] == "1"          # directories written before 'version'
    with pytest.raises(ValueError, match="quantization_config.modules_to_not_convert lists it"):
        config = json.loads((packed / "s3d8" / "config.json").read_text())
        config["quantization_config"]["modules_to_not_convert"] = ["language_model.lm_head"]
        d = shutil.copytree(packed / "s3d8", Path(str(packed) + "-listed"), dirs_exist_ok=True)
        (d / "config.json").write_text(json.dumps(config))
        from_pretrained(d)


# --- 6: the way to the project ----------------------------------------------------------------------------

def test_card_and_config_lead_to_the_project(packed):
    card = (packed / "s3d8" / "README.md").read_text()
    assert INSTALL in card and "pip install s3d8-pipeline" not in card and "not on PyPI" in card
    config = json.loads((packed / "s3d8" / "config.json").read_text())
    assert INSTALL in config[HINT_KEY] and "import pipeline" in config[HINT_KEY]


# --- the generic guard: a packed text-only Llama ----------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
def test_packed_llama_loads_with_auto_model_for_causal_lm(teacher, tmp_path, tied):
    """A text-only Llama (tied lm_head: SmolLM2, Llama 3.2 1B) through the generic guard ``s3d8-pipeline-llama``:
    the tied lm_head shares the embedding's packed tensors, stored once, and saves back byte for byte."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pipeline.recipe import quantised_modules

    config = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).to(torch.bfloat16)
    base.save_pretrained(tmp_path / "llama")
    AutoTokenizer.from_pretrained(teacher).save_pretrained(tmp_path / "llama")
    tokenizer_config = tmp_path / "llama" / "tokenizer_config.json"      # a text model's tokenizer: no processor
    tokenizer_config.write_text(json.dumps({k: v for k, v in json.loads(tokenizer_config.read_text()).items()
                                            if k != "processor_class"}))
    fmt = formats.get("s3d8")
    reader = CheckpointReader(tmp_path / "llama")
    states = {name: fmt.fit(reader.get(f"{name}.weight").float()) for name, _ in quantised_modules(base)
              if f"{name}.weight" in reader}                  # a tied lm_head is the embedding's matrix
    assert ("lm_head" in states) is not tied
    out = tmp_path / "packed"
    write_model_dir(out, reader, fmt, states, teacher_dir=tmp_path / "llama", method="direct-cast",
                    base_model="tiny-llama", teacher_name="tiny-llama")
    assert json.loads((out / "config.json").read_text())["model_type"] == guard_model_type("llama")
    assert "pipeline_tag: text-generation" in (out / "README.md").read_text()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                 quantization_config=PackedQuantConfig(kernel="torch", act_quant=False))
    assert model.lm_head.packed_tensors["packed"] is model.model.embed_tokens.packed_tensors["packed"] or not tied
    reference = LlamaForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.float32)
    ids = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        for name, state in states.items():
            weight = reference.get_submodule(name).weight
            weight.copy_(fmt.quantize(weight.float(), state))
        assert torch.equal(model(ids).logits, reference(ids).logits)
    default = AutoModelForCausalLM.from_pretrained(out)               # native kernels, bf16
    default.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / "saved")(ids).logits, default(ids).logits)


@pytest.mark.parametrize("first", ["pipeline.hf.write", "pipeline.hf.config", "pipeline.hf.quantizer", "pipeline.packed.file"])
def test_the_registration_runs_whichever_module_is_imported_first(first):
    """The registration runs when transformers is first imported, which can happen halfway through importing one of
    the Hugging Face modules: every order still registers the packed formats."""
    code = (f"import {first}, transformers\n"
            "from transformers.quantizers import auto\n"
            "assert 's3d8' in auto.AUTO_QUANTIZER_MAPPING and 's3d8' in auto.AUTO_QUANTIZATION_CONFIG_MAPPING\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
