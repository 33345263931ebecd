"""Packed files: SPEC section 7 layout, streaming write, load back, equal to the QAT forward."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from pipeline import formats
from pipeline.packed.checkpoint import CheckpointReader
from pipeline.packed.safetensors_io import StreamingWriter
from pipeline.models import load_model, meta_model, quantised_weight_names, states_by_module
from pipeline.packed.file import load_packed_model, write_packed
from pipeline.packed.modules import LazyPackedEmbedding, LazyPackedLinear, PackedEmbedding, PackedLinear
from pipeline.qat.api import prepare
from tests.conftest import tiny_inputs


def fit_all(checkpoint, fmt):
    reader = CheckpointReader(checkpoint)
    model = meta_model(load_model(str(checkpoint), torch.float32).config)
    names = quantised_weight_names(model)
    return {saved.removesuffix(".weight"): formats.get(fmt).fit(reader.get(saved)) for saved in names.values()}


def test_streaming_writer_round_trip_and_atomicity(tmp_path):
    tensors = {"b": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "a": torch.tensor([1, 2], dtype=torch.uint8)}
    specs = [(k, v.dtype, tuple(v.shape)) for k, v in sorted(tensors.items())]
    with StreamingWriter(tmp_path / "x.safetensors", specs, {"k": "v"}) as w:
        for k, v in sorted(tensors.items()):
            w.write(k, v)
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:
        assert f.metadata() == {"k": "v"}
        assert all(torch.equal(f.get_tensor(k), v) for k, v in tensors.items())
    with pytest.raises(RuntimeError, match="not written"):
        with StreamingWriter(tmp_path / "y.safetensors", specs) as w:
            w.write("a", tensors["a"])
    assert not (tmp_path / "y.safetensors").exists()
    assert list(tmp_path.iterdir()) == [tmp_path / "x.safetensors"], "no temporary file left behind"


@pytest.mark.parametrize("fmt", ["s3d8", "int", "student_t", "lloyd_max"])
def test_packed_model_equals_the_qat_forward(tiny_checkpoint, tmp_path, fmt):
    states = fit_all(tiny_checkpoint, fmt)
    out = tmp_path / f"{fmt}.safetensors"
    teacher = load_model(str(tiny_checkpoint), torch.float32)
    summary = write_packed(out, CheckpointReader(tiny_checkpoint), formats.get(fmt), states, dtype=torch.float32,
                           metadata={"config": teacher.config.to_dict()})
    assert summary["file_bytes"] == out.stat().st_size
    packed_model = load_packed_model(out)
    lazy_model = load_packed_model(out, decode="lazy")
    qat = load_model(str(tiny_checkpoint), torch.float32)
    prepare(qat, formats.get(fmt), states_by_module(qat, states), act_quant=True)
    inputs = tiny_inputs()
    with torch.no_grad():
        expected = qat(**inputs).logits
        assert torch.equal(packed_model(**inputs).logits, expected)
        assert torch.equal(lazy_model(**inputs).logits, expected), "decode='lazy' is bit-exact too"
    lazy = dict(lazy_model.named_modules())
    for name, module in packed_model.named_modules():
        if isinstance(module, (PackedLinear, PackedEmbedding)):
            assert isinstance(lazy[name], (LazyPackedLinear, LazyPackedEmbedding))
            assert torch.equal(lazy[name].weight, module.weight), name
    assert sum(b.numel() * b.element_size() for b in lazy_model.buffers()) < summary["file_bytes"]


def test_lazy_embedding_decodes_rows_in_blocks(tiny_checkpoint, tmp_path, monkeypatch):
    """Row blocks smaller than the table: every looked-up row equals the eagerly decoded one."""
    import pipeline.packed.modules as packed

    monkeypatch.setattr(packed, "_ROW_BLOCK_ELEMS", 48 * 6)      # 6 rows per block
    for fmt in ("s3d8", "int", "student_t"):
        states = fit_all(tiny_checkpoint, fmt)
        out = tmp_path / f"{fmt}.safetensors"
        teacher = load_model(str(tiny_checkpoint), torch.float32)
        write_packed(out, CheckpointReader(tiny_checkpoint), formats.get(fmt), states, dtype=torch.float32,
                     metadata={"config": teacher.config.to_dict()})
        eager = load_packed_model(out).model.language_model.embed_tokens
        lazy = load_packed_model(out, decode="lazy").model.language_model.embed_tokens
        ids = torch.tensor([[0, 5, 67, 5], [13, 6, 12, 66]])
        assert torch.equal(lazy(ids), eager(ids))
        with pytest.raises(IndexError):
            lazy(torch.tensor([68]))
    with pytest.raises(ValueError, match="decode"):
        load_packed_model(out, decode="sometimes")


@pytest.mark.parametrize("fmt", ["s3d8", "int"])
def test_lazy_linear_decodes_big_weights_in_row_blocks(tiny_checkpoint, tmp_path, monkeypatch, fmt):
    """With a block far smaller than the weights (as the 11B's lm_head is to 256 MB), the logits equal the
    eagerly decoded model's up to float summation order: each output is the same dot product, but BLAS may
    pick another kernel for a 6-row matrix (measured: equal bit for bit at 3,000 x 4,096 blocks)."""
    import pipeline.packed.modules as packed

    states = fit_all(tiny_checkpoint, fmt)
    out = tmp_path / f"{fmt}.safetensors"
    teacher = load_model(str(tiny_checkpoint), torch.float32)
    write_packed(out, CheckpointReader(tiny_checkpoint), formats.get(fmt), states, dtype=torch.float32,
                 metadata={"config": teacher.config.to_dict()})
    inputs = tiny_inputs()
    with torch.no_grad():
        expected = load_packed_model(out)(**inputs).logits
        monkeypatch.setattr(packed, "_LINEAR_BLOCK_ELEMS", 48 * 7)       # 6 rows of 48 inputs per block
        calls = []
        original = F.linear
        monkeypatch.setattr(packed.F, "linear", lambda x, w, b=None: calls.append(w.shape[0]) or original(x, w, b))
        torch.testing.assert_close(load_packed_model(out, decode="lazy")(**inputs).logits, expected,
                                   rtol=1e-5, atol=1e-5)
    assert 6 in calls


def test_s3d8_file_follows_spec_section_7(tiny_checkpoint, tmp_path):
    states = fit_all(tiny_checkpoint, "s3d8")
    out = tmp_path / "s3d8.safetensors"
    write_packed(out, CheckpointReader(tiny_checkpoint), formats.get("s3d8"), states)
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
        assert meta["llama_mobile_format"] == "llama-mobile-s3d8-packed-v1"
        name = "language_model.model.layers.0.mlp.up_proj.weight"
        assert f.get_tensor(f"{name}.packed").dtype == torch.uint8 and f.get_tensor(f"{name}.packed").dim() == 1
        assert f.get_tensor(f"{name}.packed").numel() == -(-64 // 3) * 48
        assert f.get_tensor(f"{name}.scale").dtype == torch.bfloat16 and f.get_tensor(f"{name}.scale").shape == (64, 1)
        assert f.get_tensor(f"{name}.table").dtype == torch.int8 and f.get_tensor(f"{name}.table").shape == (32, 3)
        assert f.get_tensor("language_model.model.norm.weight").dtype == torch.bfloat16
        assert "vision_model.patch_embedding.weight" in f.keys()          # the conv is not quantised
        assert "language_model.lm_head.weight.packed" in f.keys()
        assert json.loads(meta["shapes"])[name] == [64, 48]
        assert 2.6 < float(meta["bits_per_param_nominal"]) < float(meta["bits_per_param_actual"])


def test_bad_packed_files_name_the_tensor(tiny_checkpoint, tmp_path):
    states = fit_all(tiny_checkpoint, "s3d8")
    teacher = load_model(str(tiny_checkpoint), torch.float32)
    good = tmp_path / "good.safetensors"
    write_packed(good, CheckpointReader(tiny_checkpoint), formats.get("s3d8"), states, metadata={"config": teacher.config.to_dict()})
    with safe_open(str(good), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    victim = "language_model.model.layers.0.mlp.up_proj.weight"
    broken = dict(tensors)
    del broken[f"{victim}.table"]
    save_file(broken, str(tmp_path / "missing.safetensors"), metadata=meta)
    with pytest.raises(ValueError, match=f"{victim}.table"):
        load_packed_model(tmp_path / "missing.safetensors")
    broken = dict(tensors)
    broken[f"{victim}.packed"] = broken[f"{victim}.packed"][:-5].clone()
    save_file(broken, str(tmp_path / "short.safetensors"), metadata=meta)
    with pytest.raises(ValueError, match=victim):
        load_packed_model(tmp_path / "short.safetensors")
    broken = dict(tensors)
    del broken["language_model.model.norm.weight"]
    save_file(broken, str(tmp_path / "nonorm.safetensors"), metadata=meta)
    with pytest.raises(ValueError, match="language_model.model.norm.weight"):
        load_packed_model(tmp_path / "nonorm.safetensors")
    (tmp_path / "garbage.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(ValueError, match="garbage.safetensors"):
        load_packed_model(tmp_path / "garbage.safetensors")


def test_native_kernel_model_matches_the_decoded_model(tiny_checkpoint, tmp_path):
    pytest.importorskip("pipeline._s3d8_native")
    states = fit_all(tiny_checkpoint, "s3d8")
    out = tmp_path / "s3d8.safetensors"
    teacher = load_model(str(tiny_checkpoint), torch.float32)
    write_packed(out, CheckpointReader(tiny_checkpoint), formats.get("s3d8"), states, dtype=torch.float32,
                 metadata={"config": teacher.config.to_dict()})
    inputs = tiny_inputs()
    with torch.no_grad():
        decoded = load_packed_model(out)(**inputs).logits
        native = load_packed_model(out, kernel="native")(**inputs).logits
        native_lazy = load_packed_model(out, kernel="native", decode="lazy")(**inputs).logits
    assert torch.allclose(native, decoded, rtol=1e-4, atol=1e-4)
    assert torch.equal(native_lazy, native), "lazy embeddings give the same numbers under the native kernels"
    with pytest.raises(ValueError, match="native"):
        load_packed_model(out, kernel="native", act_quant=False)
