"""The synthetic Llama 3.2 11B Vision (``pipeline.synthetic.vision``) at toy size: every tensor of the Mllama config
written straight into packed files under the precision plan, loadable by the runtime like any packed model, and
the vision benchmark (``pipeline.bench.generate --models synthetic-vision-tiny``) that measures one image and a
question on it."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline import native
from pipeline.synthetic.shape import skeleton_config
from pipeline.packed.file import read_metadata
from pipeline.synthetic.vision import PRESETS, tensors, write_vision

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_vision("synthetic-vision-tiny", tmp_path_factory.mktemp("synth"))


def test_every_tensor_at_its_shape_in_the_plans_formats(files):
    from safetensors import safe_open

    shapes, quantised = tensors(skeleton_config(PRESETS["synthetic-vision-tiny"]))
    assert any("vision_model" in n for n in quantised) and any("cross_attn" in n for n in quantised)
    for stem, path in files.items():
        meta = read_metadata(path)
        assert json.loads(meta["shapes"]) == {n: list(shapes[n]) for n in quantised}
        others = json.loads(meta["formats"])
        if stem == "s3d8":
            assert meta["format"] == "s3d8" and set(others) == {n for n in quantised if "embed_tokens" in n}
            assert set(others.values()) == {"int8"}
        else:
            assert meta["format"] == "int8" and others == {}
        with safe_open(str(path), "pt") as f:
            keys = set(f.keys())
        plain = {n for n in shapes if n not in quantised}
        assert plain <= keys and all(any(k.startswith(n + ".") for k in keys) for n in quantised)


def test_the_runtime_runs_both_files_on_the_native_kernels(files):
    from pipeline.runtime import generation as runtime
    from pipeline.bench.vision import answer, inputs
    from pipeline.runtime.models import hf_mllama, model_kind, read_header

    for stem, path in files.items():
        assert model_kind(path) == ("mllama", stem)
        model = hf_mllama(path)
        fc1 = model.model.vision_model.transformer.layers[0].mlp.fc1
        assert isinstance(fc1, native.S3D8Linear if stem == "s3d8" else native.Int8Linear) and fc1.bias is not None
        big, rows = _big_buffers(model)
        assert big and len({b.untyped_storage().data_ptr() for b in big}) == 1, "one block of private memory"
        assert rows and {b.untyped_storage().data_ptr() for b in rows}.isdisjoint(
            {b.untyped_storage().data_ptr() for b in big}), "the embedding mapped from the file, not read"
        processor = runtime.processor_for(path, read_header(path)[1], None)
        batch = inputs(processor, (112, 112))
        assert batch["pixel_values"].shape[2] == 4                       # 4 tiles, as the 11B tiles a 2 x 2 picture
        res = answer(model, batch, 4)
        assert res["image_tokens"] == 4 * 17 and res["time_to_first_token_s"] > 0


def test_int8_linear_adds_its_bias():
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (6, 32), dtype=torch.int8, generator=gen)
    scale = torch.rand(6, 1, generator=gen).to(torch.bfloat16)
    bias = torch.randn(6, generator=gen)
    x = torch.randn(3, 32, generator=gen)
    assert torch.equal(native.Int8Linear(w, scale, bias)(x), native.Int8Linear(w, scale)(x) + bias)
    with pytest.raises(ValueError, match="bias"):
        native.Int8Linear(w, scale, torch.zeros(5))


def test_generate_bench_measures_an_image_and_a_question(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "pipeline.bench.generate", "--models", "synthetic-vision-tiny",
                    "--threads", "1", "--new-tokens", "4", "--out", str(tmp_path)], check=True, cwd=REPO, env=env,
                   capture_output=True, timeout=600)
    data = json.loads((tmp_path / "bench_generate.json").read_text())
    rows = {r["format"]: r for r in data["records"]}
    assert set(rows) == {"s3d8", "int8"} and all("error" not in r for r in rows.values())
    assert rows["s3d8"]["weight_bytes"] < rows["int8"]["weight_bytes"] and rows["s3d8"]["image_tokens"] == 68
    assert "One image and a question" in (tmp_path / "bench_generate.md").read_text()


def _big_buffers(model) -> tuple[list, list]:
    """``(buffers of 4 KB or more outside the embeddings, the embeddings')`` of a runtime Mllama (its embeddings: the
    token embedding and the vision tower's tile embeddings, which decode the rows they look up)."""
    rows = (native.S3D8RowEmbedding, native.Int8RowEmbedding)
    big = [(isinstance(m, rows), b) for m in model.modules() for b in m._buffers.values()
           if b is not None and b.nbytes >= 4096]
    return [b for r, b in big if not r], [b for r, b in big if r]


def _mapped_rss_kb(path) -> int | None:
    """Resident kB of this process's mappings of ``path`` (/proc/self/smaps); None where there is no such file."""
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        return None
    total, inside, name = 0, False, str(Path(path).resolve())
    for line in smaps.read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            inside = line.endswith(name)
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total


def test_the_runtime_reads_the_file_into_private_memory_once(files):
    """hf_mllama's tensors are the file's bytes read into one private block: equal to the mapped load's, 64-byte
    aligned; the token embedding alone stays mapped from the file, none of its pages resident after the load's
    check read them all (a lookup brings in the rows it reads)."""
    from pipeline.packed.file import load_packed_model
    from pipeline.runtime.models import hf_mllama

    path = files["s3d8"]
    mapped = dict(load_packed_model(path, kernel="native", decode="lazy").state_dict())
    private = load_packed_model(path, kernel="native", decode="lazy", private=True).state_dict()
    assert mapped.keys() == private.keys()
    assert all(torch.equal(mapped[k], private[k]) for k in mapped)
    del mapped, private
    gc.collect()
    model = hf_mllama(path)
    embedding = model.model.language_model.embed_tokens
    assert all(b.data_ptr() % 64 == 0 for b in _big_buffers(model)[0])
    if _mapped_rss_kb(path) is not None:
        assert _mapped_rss_kb(path) <= 8                   # a page or two: the header's neighbours
        with torch.inference_mode():
            rows = embedding(torch.tensor([[3, 900]]))
        assert _mapped_rss_kb(path) > 0                    # rows come in as they are looked up
        assert torch.equal(rows, plain_rows(path, [3, 900]))


def plain_rows(path, ids):
    """The embedding rows of the packed file ``path`` as the mapped (non-private) load decodes them."""
    from pipeline.packed.file import load_packed_model

    model = load_packed_model(path, kernel="native", decode="lazy")
    with torch.inference_mode():
        return model.model.language_model.embed_tokens(torch.tensor([ids]))


def test_a_mapped_tensor_is_the_files_bytes_and_its_pages_go_back(tmp_path):
    from pipeline.packed.checkpoint import CheckpointReader
    from pipeline.packed.safetensors_io import write_tensors

    path = tmp_path / "t.safetensors"
    table = torch.arange(4096 * 4096, dtype=torch.int32).reshape(4096, 4096) % 251
    write_tensors(path, {"a": table.to(torch.int8), "s": torch.ones(64, dtype=torch.bfloat16)})
    reader = CheckpointReader(path, private=True)
    a = reader.get("a", mapped=True)
    assert torch.equal(a, table.to(torch.int8)) and torch.equal(reader.get("s", mapped=True), torch.ones(64).bfloat16())
    if _mapped_rss_kb(path) is not None:
        assert _mapped_rss_kb(path) >= 16000              # the comparison read every page (16 MB)
        reader.drop_mapped()
        assert _mapped_rss_kb(path) <= 8
        assert torch.equal(a[1600], table[1600].to(torch.int8))
        assert _mapped_rss_kb(path) <= 4096                # a row's page and its neighbours (a large folio at most)


def test_the_runtimes_vision_encoder_keeps_only_what_is_read_and_changes_no_number(files, monkeypatch):
    """... and its MLPs on blocks of tokens (7 here, so that the tiny image spans several) give the same numbers."""
    from pipeline.runtime import generation as runtime
    from pipeline.bench.vision import inputs
    from pipeline.packed.file import load_packed_model
    from pipeline.runtime import models
    from pipeline.runtime.models import VisionEncoder, hf_mllama, read_header

    monkeypatch.setattr(models, "ROW_BLOCK", 7)
    path = files["s3d8"]
    lean, plain = hf_mllama(path), load_packed_model(path, kernel="native", decode="lazy")
    assert lean.model.vision_model.transformer.layers[0].mlp.row_block == 7
    assert lean.model.vision_model.transformer.layers[0].self_attn.q_proj.row_block == 7
    assert lean.model.multi_modal_projector.row_block == 7
    vision = lean.model.vision_model
    assert isinstance(vision.transformer, VisionEncoder) and isinstance(vision.global_transformer, VisionEncoder)
    batch = inputs(runtime.processor_for(path, read_header(path)[1], None), (112, 112))
    args = {k: batch[k] for k in ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask")}
    with torch.inference_mode():
        states = vision.transformer(torch.randn(1, 72, vision.hidden_size)).hidden_states
        assert [i for i, s in enumerate(states) if s is not None] == sorted(set(vision.intermediate_layers_indices))
        assert torch.equal(vision(**args).last_hidden_state, plain.model.vision_model(**args).last_hidden_state)


def test_a_private_read_names_the_file_and_tensor_it_cannot_read(tmp_path):
    from pipeline.packed.checkpoint import CheckpointReader
    from pipeline.packed.safetensors_io import write_tensors

    path = tmp_path / "t.safetensors"
    write_tensors(path, {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(5, dtype=torch.int8)})
    reader = CheckpointReader(path, private=True)
    assert torch.equal(reader.get("a"), torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert reader.get("b").data_ptr() % 64 == 0
    with pytest.raises(KeyError, match="no tensor 'c'"):
        reader.get("c")
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    bad = raw[:8 + n].replace(b'"I8"', b'"F32"') + raw[8 + n:]      # 5 bytes where F32 [5] needs 20
    path.write_bytes(bytes(bad))
    with pytest.raises(ValueError, match=r"t\.safetensors"):
        CheckpointReader(path, private=True).get("b")


def test_the_decode_step_reads_the_image_keys_and_values_where_the_cache_holds_them(files):
    """The C decoder's cross-attention layers point at the prompt cache's K/V (float32, contiguous): no second copy
    of the image's keys and values (0.4 GB at the 11B's four tiles) beside the cache."""
    from pipeline.runtime import generation as runtime
    from pipeline.bench.vision import inputs
    from pipeline.runtime.models import hf_mllama, mllama_step, read_header

    path = files["s3d8"]
    model = hf_mllama(path)
    batch = inputs(runtime.processor_for(path, read_header(path)[1], None), (112, 112))
    with torch.inference_mode():
        out = model(**batch, use_cache=True, logits_to_keep=1)
        step = mllama_step(model, out.past_key_values, batch["input_ids"].shape[-1] + 4, batch["cross_attention_mask"])
    cross = [i for i, layer in enumerate(model.model.language_model.layers) if hasattr(layer, "cross_attn")]
    held = {t.data_ptr() for t in step._keep}
    for i in cross:
        keys, values = out.past_key_values.layers[i].keys, out.past_key_values.layers[i].values
        assert keys.dtype == torch.float32 and keys[0].is_contiguous()
        assert keys[0].data_ptr() in held and values[0].data_ptr() in held


def test_a_decode_token_reads_the_text_weights_and_head_not_the_image_side(files):
    """The bandwidth bound of a decode token: the text layers and the output head, not the vision tower, the
    projector, the image keys and values (prefill) or an untied embedding (a row a token)."""
    from pipeline.bench.vision import decode_bytes
    from pipeline.packed.safetensors_io import read_header

    for path in files.values():
        entries = read_header(path)[0]
        size = {n: e["data_offsets"][1] - e["data_offsets"][0] for n, e in entries.items()}
        text = sum(b for n, b in size.items() if n.startswith("language_model.") and "embed_tokens" not in n
                   and ".cross_attn.k_proj." not in n and ".cross_attn.v_proj." not in n)
        assert any("lm_head" in n for n in size) and decode_bytes(path) == text
        assert decode_bytes(path) < sum(size.values()) - sum(b for n, b in size.items() if "vision_model." in n)


def test_the_cross_attention_shares_the_image_key_value_heads_with_the_same_numbers(files):
    """The runtime's cross-attention layers read grouped key/value heads through torch's SDPA (no repeated copies of
    the image keys and values): the prompt's logits are the same bits as with transformers' SDPA."""
    from pipeline.bench.vision import inputs
    from pipeline.runtime import generation as runtime
    from pipeline.runtime.models import SHARED_KV, hf_mllama, read_header

    path = files["s3d8"]
    model = hf_mllama(path)
    cross = [layer.cross_attn for layer in model.model.language_model.layers if hasattr(layer, "cross_attn")]
    assert cross and all(a.config._attn_implementation == SHARED_KV for a in cross)
    assert model.model.language_model.config._attn_implementation != SHARED_KV
    assert cross[0].num_key_value_groups > 1
    batch = inputs(runtime.processor_for(path, read_header(path)[1], None), (112, 112))
    with torch.inference_mode():
        shared = model(**batch).logits
        for a in cross:
            a.config = model.model.language_model.config
        assert torch.equal(model(**batch).logits, shared)
