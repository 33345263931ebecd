"""Packed model directories (pipeline/hf/quantizer.py): the layout pack-safetensors writes, from_pretrained equal to
load_packed_model bit for bit (same kernel, decode and dtype), weights packed in memory by default, the native
kernel option, sharding, plain transformers refusing loudly, bad input. tests/test_hf_traps.py: issue 23's traps."""

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
from pipeline.cast.fit import fit_model
from pipeline.hf.quantizer import PackedQuantConfig
from pipeline.hf.config import INDEX_NAME, MODEL_TYPE
from pipeline.hf.write import fill_card, weight_bytes, write_model_dir
from pipeline.packed.safetensors_io import tensor_specs
from pipeline.models import load_config
from pipeline.packed.file import load_packed_model, read_metadata
from pipeline.packed.modules import LazyPackedEmbedding, LazyPackedLinear, PackedLinear
from tests.stage_helpers import build_tiny_teacher

SHARD_LIMIT = 60_000          # bytes: the int model (about 190 kB) is written as several shards


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return build_tiny_teacher(tmp_path_factory.mktemp("teacher"))


def write(teacher: Path, fmt: str, out: Path, max_shard_size: int = 5 * 10**9) -> dict:
    f = formats.get(fmt)
    states, _ = fit_model(f, str(teacher))
    return write_model_dir(out, CheckpointReader(teacher), f, states, teacher_dir=teacher, method="qat",
                           base_model=str(teacher), teacher_name="toy-mllama",
                           metadata={"config": load_config(str(teacher)).to_dict(), "method": "qat",
                                     "source_model": str(teacher), "teacher": "toy-mllama"},
                           max_shard_size=max_shard_size)


@pytest.fixture(scope="module")
def packed(tmp_path_factory, teacher):
    root = tmp_path_factory.mktemp("packed")
    write(teacher, "s3d8", root / "s3d8")
    write(teacher, "int", root / "int", max_shard_size=SHARD_LIMIT)
    return root


def inputs(config, batch: int = 2, length: int = 9) -> dict:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, config.text_config.vocab_size, (batch, length), generator=gen)
    ids[:, 1] = config.image_token_index
    size = config.vision_config.image_size
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "pixel_values": torch.randn(batch, 1, 1, 3, size, size, generator=gen),
            "aspect_ratio_ids": torch.ones(batch, 1, dtype=torch.long),
            "aspect_ratio_mask": torch.ones(batch, 1, 1, dtype=torch.long),
            "cross_attention_mask": torch.ones(batch, length, 1, 1, dtype=torch.long)}


def from_pretrained(path, **kwargs):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(path), **kwargs)


def test_layout(packed):
    s3d8 = packed / "s3d8"
    assert sorted(p.name for p in s3d8.iterdir()) == sorted([
        "README.md", "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "processor_config.json", "tokenizer.json", "tokenizer_config.json"])
    config = json.loads((s3d8 / "config.json").read_text())
    assert config["model_type"] == MODEL_TYPE
    qc = config["quantization_config"]
    assert qc == {"quant_method": "s3d8", "format": "s3d8", "version": "1", "layout": "llama-mobile-s3d8-packed-v1",
                  "bits_per_weight": qc["bits_per_weight"], "modules_to_not_convert": []}
    assert qc["bits_per_weight"] == float(read_metadata(s3d8 / "model.safetensors")["bits_per_param_nominal"])
    assert read_metadata(s3d8 / "model.safetensors")["llama_mobile_format"] == "llama-mobile-s3d8-packed-v1"
    card = (s3d8 / "README.md").read_text()
    assert card.startswith("---\n") and "library_name: transformers" in card and "reports/eval.json" in card
    # int: shards of the same tensors, each with the packed metadata, listed by the index
    config = json.loads((packed / "int" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "s3d8-pipeline-int"
    index = json.loads((packed / "int" / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (packed / "int" / "model.safetensors").exists()
    for shard in shards:
        tensors, meta = tensor_specs(packed / "int" / shard)
        assert meta["format"] == "int" and set(tensors) == {k for k, v in index["weight_map"].items() if v == shard}
        assert sum((packed / "int" / s).stat().st_size for s in shards) < 3 * SHARD_LIMIT + 20_000
    parts = {k.rpartition(".")[0]: v for k, v in index["weight_map"].items() if k.endswith(".codes")}
    assert all(index["weight_map"][f"{base}.{s}"] == file for base, file in parts.items() for s in ("scale", "codepoints"))


@pytest.mark.parametrize("fmt", ["s3d8", "int"])
@pytest.mark.parametrize("decode", ["eager", "lazy"])
def test_from_pretrained_equals_load_packed_model(packed, fmt, decode):
    path = packed / fmt
    file = path / "model.safetensors" if fmt == "s3d8" else path
    reference = load_packed_model(file, decode=decode)      # fp32, kernel torch: the QAT forward
    model = from_pretrained(path, dtype=torch.float32,
                            quantization_config=PackedQuantConfig(kernel="torch", decode=decode))
    layer = model.model.language_model.layers[0].mlp.up_proj
    assert isinstance(layer, PackedLinear if decode == "eager" else LazyPackedLinear)
    assert model.config.quantization_config.format == fmt
    x = inputs(model.config)
    with torch.no_grad():
        assert torch.equal(model(**x).logits, reference(**x).logits)


@pytest.mark.parametrize("fmt", ["s3d8", "int"])
def test_from_pretrained_keeps_weights_packed_by_default(packed, fmt):
    """The default computes in config.json's dtype (bf16) with the weights packed in memory: S3D8 on the native
    kernels, the other formats decoded in each forward; the same numbers as load_packed_model with those options."""
    from pipeline.native import S3D8Linear, S3D8RowEmbedding

    path = packed / fmt
    model = from_pretrained(path)
    kernel = "native" if fmt == "s3d8" else "torch"
    assert isinstance(model.model.language_model.layers[0].mlp.up_proj,
                      S3D8Linear if kernel == "native" else LazyPackedLinear)
    assert isinstance(model.model.language_model.embed_tokens,         # the looked-up rows decoded natively
                      S3D8RowEmbedding if kernel == "native" else LazyPackedEmbedding)
    assert model.dtype == torch.bfloat16
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    on_disk = weight_bytes(path)
    assert held < 1.05 * on_disk, (held, on_disk)
    decoded = from_pretrained(path, quantization_config=PackedQuantConfig(decode="eager", kernel="torch"))
    assert sum(t.numel() * t.element_size() for t in decoded.state_dict().values()) > 2.5 * on_disk
    reference = load_packed_model(path / "model.safetensors" if fmt == "s3d8" else path, kernel=kernel,
                                  decode="lazy", dtype=torch.bfloat16)
    x = inputs(model.config)
    with torch.no_grad():
        assert torch.equal(model(**x).logits, reference(**x).logits)


def test_native_kernel_on_request(packed):
    from pipeline.native import S3D8Linear

    path = packed / "s3d8"
    with pytest.warns(UserWarning, match="loading attributes"):
        model = from_pretrained(path, dtype=torch.float32, device_map="cpu",
                                quantization_config=PackedQuantConfig(kernel="native"))
    assert isinstance(model.model.language_model.layers[0].mlp.up_proj, S3D8Linear)
    products = [m.packed for m in model.modules() if isinstance(m, S3D8Linear)]     # one block, as the runtime's
    assert len({t.untyped_storage().data_ptr() for t in products}) == 1 and all(t.data_ptr() % 64 == 0 for t in products)
    reference = load_packed_model(path / "model.safetensors", kernel="native")
    x = inputs(model.config)
    with torch.no_grad():
        assert torch.equal(model(**x).logits, reference(**x).logits)
    with pytest.raises(ValueError, match="device_map='cpu'"):
        from_pretrained(path, device_map="cuda:0", quantization_config=PackedQuantConfig(kernel="native"))
    with pytest.raises(ValueError, match="kernel 'native'"):
        from_pretrained(packed / "int", quantization_config=PackedQuantConfig(kernel="native"))


PLAIN = """
import json, shutil, sys
from transformers import AutoModelForImageTextToText
packed, scratch = sys.argv[1], sys.argv[2]
try:
    AutoModelForImageTextToText.from_pretrained(packed)
    print("LOADED")
except ValueError as e:
    print("REFUSED", e)
# Why the guard: with model_type "mllama" and only an unknown quant_method, transformers warns and goes on.
shutil.copytree(packed, scratch)
config = json.load(open(scratch + "/config.json"))
config["model_type"] = "mllama"
json.dump(config, open(scratch + "/config.json", "w"))
AutoModelForImageTextToText.from_pretrained(scratch)
print("UNGUARDED LOADED", "pipeline" in sys.modules)
"""


def test_plain_transformers_refuses(packed, tmp_path):
    proc = subprocess.run([sys.executable, "-c", PLAIN, str(packed / "s3d8"), str(tmp_path / "unguarded")],
                          cwd=tmp_path, capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin"})
    assert proc.returncode == 0, proc.stderr
    assert f"REFUSED The checkpoint you are trying to load has model type `{MODEL_TYPE}`" in proc.stdout
    assert "LOADED\n" not in proc.stdout.replace("UNGUARDED LOADED", "")
    assert "UNGUARDED LOADED False" in proc.stdout and "s3d8" in proc.stderr     # warned, random weights


def test_bad_directories(packed, tmp_path):
    no_config = shutil.copytree(packed / "s3d8", tmp_path / "no-config")
    (no_config / "config.json").unlink()
    with pytest.raises((OSError, ValueError), match="config.json"):
        from_pretrained(no_config)

    other = shutil.copytree(packed / "s3d8", tmp_path / "other-method")      # config says int, file is s3d8
    config = json.loads((other / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "s3d8-pipeline-int", "format": "int"}
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model\.safetensors: metadata 'format' is 's3d8'.*quantization_config\.format"):
        from_pretrained(other)

    config["quantization_config"] = {"quant_method": "s3d8", "format": "int"}
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization_config.quant_method is 's3d8'"):
        from_pretrained(other)

    config["quantization_config"] = {"quant_method": "s3d8", "format": "s3d8", "bits": 3}
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantization_config: unknown field\(s\) \['bits'\]"):
        from_pretrained(other)

    missing = shutil.copytree(packed / "int", tmp_path / "missing-shard")
    (missing / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors\.index\.json: 'weight_map' names "
                                                r"model-00002-of-00003\.safetensors"):
        from_pretrained(missing)


def test_card_gets_the_scores(packed, tmp_path):
    result = {"models": {
        "bf16-teacher": {"format": "bf16", "method": "teacher", "bpp": 16.0, "size_mb": 1.0, "kl": 0.0,
                         "scores": {"toy-vqa": 1.0, "toy-ai2d": 0.5}, "avg": 0.75},
        "s3d8-qat": {"format": "s3d8", "method": "qat", "bpp": 2.92, "size_mb": 0.2, "kl": 0.05,
                     "scores": {"toy-vqa": 0.9, "toy-ai2d": 0.4}, "avg": 0.65}}}
    (tmp_path / "eval.json").write_text(json.dumps(result))
    card = fill_card(packed / "s3d8", tmp_path / "eval.json", tmp_path / "README.md").read_text()
    assert "| s3d8-qat | 2.92 | 0.0500 | 0.900 | 0.400 | 0.650 |" in card
    assert "| bf16-teacher | 16.00 | 0.0000 | 1.000 | 0.500 | 0.750 |" in card
    text = {"models": {                                 # a text model's eval: KL, top-1 agreement, perplexity
        "bf16-teacher": {"format": "bf16", "method": "teacher", "bpp": 16.0, "size_mb": 1.0, "kl": 0.0,
                         "top1_agreement": 1.0, "perplexity": 16.61},
        "s3d8-qat": {"format": "s3d8", "method": "qat", "bpp": 3.68, "size_mb": 0.2, "kl": 0.4,
                     "top1_agreement": 0.72, "perplexity": 19.43}}}
    (tmp_path / "eval.json").write_text(json.dumps(text))
    card = fill_card(packed / "s3d8", tmp_path / "eval.json", tmp_path / "README.md").read_text()
    assert "| s3d8-qat | 3.68 | 0.4000 | 0.720 | 19.43 |" in card and "every linear and embedding weight" in card


def test_import_pipeline_stays_cheap():
    proc = subprocess.run([sys.executable, "-c", "import sys, pipeline; print('transformers' in sys.modules)"],
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert proc.stdout.strip() == "False", proc.stderr


def test_a_precision_plan_loads_through_transformers_and_saves_back(teacher, tmp_path):
    """A directory whose token embedding and down projections are INT8 (the rest S3D8): quantization_config.formats
    says so, from_pretrained loads each weight in its format (the QAT forward's numbers with kernel torch, the
    native kernels by default) and save_pretrained writes the same bytes back."""
    from pipeline.native import Int8Linear, S3D8Linear
    from pipeline.formats.precision import Precision

    fmt = formats.get("s3d8")
    states, _ = fit_model(fmt, str(teacher))
    plan = Precision(fmt, {r"embed_tokens$": "int8", r"mlp\.down_proj$": "int8"})
    other = {n: f for n in states if (f := plan.format_of(n)) is not fmt}
    out = tmp_path / "mixed"
    write_model_dir(out, CheckpointReader(teacher), fmt, states, teacher_dir=teacher, method="direct-cast",
                    base_model=str(teacher), teacher_name="toy-mllama", other=other,
                    metadata={"config": load_config(str(teacher)).to_dict(), "method": "direct-cast"})
    saved = json.loads((out / "config.json").read_text())["quantization_config"]
    assert saved["formats"] == {f"{n}.weight": "int8" for n in other} and other
    card = (out / "README.md").read_text()                      # the card says which weights are not S3D8
    assert f"({len(other)} in another format: the precision plan below)" in card
    assert all(f"| `{n}.weight` | INT8 |" in card for n in other) and "decoder Linears" in card
    reference = load_packed_model(out / "model.safetensors")
    model = from_pretrained(out, dtype=torch.float32, quantization_config=PackedQuantConfig(kernel="torch"))
    x = inputs(model.config)
    with torch.no_grad():
        assert torch.equal(model(**x).logits, reference(**x).logits)
    native = from_pretrained(out)
    layer = native.model.language_model.layers[0].mlp
    assert isinstance(layer.down_proj, Int8Linear) and isinstance(layer.up_proj, S3D8Linear)
    native.save_pretrained(tmp_path / "again")
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_the_runtime_loads_a_packed_directory_by_from_pretrained(packed, tmp_path):
    """``python -m pipeline.runtime DIR --impl from_pretrained`` and ``bench.generate --impls from_pretrained``: the
    directory through transformers' ``from_pretrained`` (its defaults), then Hugging Face generate; a file with no
    config.json beside it is refused, naming the directory."""
    from pipeline.native import S3D8Linear
    from pipeline.runtime import generation as runtime
    from pipeline.runtime.models import RuntimeInputError

    model = runtime.load(packed / "s3d8" / "model.safetensors", "from_pretrained")
    assert isinstance(model.model.language_model.layers[0].mlp.up_proj, S3D8Linear)
    assert model.weight_bytes == (packed / "s3d8" / "model.safetensors").stat().st_size
    x = {k: v[:1] for k, v in inputs(model.config, batch=1).items()}
    with torch.no_grad():
        ref = model.generate(**x, max_new_tokens=4, do_sample=False, min_new_tokens=4, eos_token_id=None,
                             pad_token_id=0)[0, x["input_ids"].shape[1]:].tolist()
    assert runtime.generate(model, x, 4, impl="from_pretrained").tokens == ref
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.safetensors").write_bytes((packed / "s3d8" / "model.safetensors").read_bytes())
    with pytest.raises(RuntimeInputError, match=f"{bare}: from_pretrained needs a packed model directory"):
        runtime.load(bare, "from_pretrained")
