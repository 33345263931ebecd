"""The reference engine's .sqt v3 file (SPEC section 9): export from a packed S3D8 model, read, validate."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys

import pytest
import torch

from pipeline import formats
from pipeline.packed.checkpoint import CheckpointReader
from pipeline.packed.safetensors_io import write_tensors
from pipeline.packed.file import write_packed
from pipeline.sqt.write import export, standard_name
from pipeline.sqt.blocks import GPT2_PATTERN, SqtUnsupported, vocab_block
from pipeline.sqt.container import MAGIC, VERSION, SqtError, align, expected_bytes
from pipeline.sqt.read import read_sqt
from tests.stage_helpers import REPO, build_tiny_teacher
from tests.test_packed import fit_all

pytestmark = pytest.mark.filterwarnings("ignore:.*ignore_merges")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A tiny toy-world teacher (gates set to distinct non-zero values) and its packed S3D8 file."""
    root = tmp_path_factory.mktemp("sqt")
    teacher = build_tiny_teacher(root / "teacher")
    reader = CheckpointReader(teacher)
    tensors = {k: reader.get(k) for k in reader.keys()}
    gates = sorted(k for k in tensors if k.endswith(("gate", "_gate", "gate_attn", "gate_ffn")))
    assert gates, "the tiny teacher has gates"
    for i, k in enumerate(gates):
        tensors[k] = torch.full_like(tensors[k], 0.3 + 0.1 * i)
    del reader
    write_tensors(teacher / "model.safetensors", tensors, {"format": "pt"})
    states = fit_all(teacher, "s3d8")
    config = json.loads((teacher / "config.json").read_text())
    out = root / "qat.safetensors"
    write_packed(out, CheckpointReader(teacher), formats.get("s3d8"), states,
                 metadata={"config": config, "method": "qat", "source_model": str(teacher)})
    return {"root": root, "teacher": teacher, "file": out, "gates": {k: float(tensors[k].float().reshape(-1)[0])
                                                                       for k in gates}}


@pytest.fixture(scope="module")
def sqt_file(packed):
    path = packed["root"] / "model.sqt"
    export(packed["file"], path)          # tokenizer from the packed file's source_model
    return path


def test_layout_follows_spec_section_9(sqt_file):
    raw = sqt_file.read_bytes()
    assert raw[:4] == MAGIC and struct.unpack("<I", raw[4:8])[0] == VERSION == 3
    assert struct.unpack("<I", raw[:4])[0] == 0x7471732E
    n = struct.unpack("<Q", raw[8:16])[0]
    header_text = raw[16:16 + n].decode()
    assert (16 + n) % 32 == 0 and header_text == header_text.rstrip(" ") + " " * (len(header_text) - len(header_text.rstrip(" ")))
    header = json.loads(header_text)
    assert json.dumps(header, separators=(",", ":")) == header_text.rstrip(" ")           # compact JSON
    meta = header.pop("__metadata__")
    assert meta["alignment"] == 32 and meta["source"] and meta["created"]
    buffer = raw[16 + n:]
    spans = []
    for name, e in header.items():
        parts = [e] + [e[k] for k in ("table", "scale") if k in e]
        for p in parts:
            b, end = p["data_offsets"]
            assert b % 32 == 0 and end - b == expected_bytes(p["dtype"], tuple(p["shape"]))
            spans.append((b, end))
        offsets = [p["data_offsets"][0] for p in parts]
        assert offsets == sorted(offsets), "buffer order per tensor: data, table, scale"
        if e["dtype"] == "S3D8":
            d_out, d_in = e["shape"]
            assert e["table"]["dtype"] == "INT8" and e["table"]["shape"] == [32, 3]
            assert e["scale"]["dtype"] == "BF16" and e["scale"]["shape"] == [d_out, 1]
            assert e["data_offsets"][1] - e["data_offsets"][0] == -(-d_out // 3) * align(d_in, 16)
    spans.sort()
    pos = 0
    for b, end in spans:
        assert b >= pos and not any(buffer[pos:b]), "gaps are zero-filled"
        pos = end
    # names: renamed, gates folded away, merged vision embeddings
    names = set(header)
    assert {"text_model.embed_tokens.weight", "text_model.lm_head.weight", "text_model.norm.weight",
            "text_model.layers.1.attn.q_norm.weight", "text_model.layers.0.attn.norm.weight",
            "text_model.layers.0.mlp.norm.weight", "vision_model.layers0.0.mlp.up_proj.bias",
            "vision_model.layers1.0.attn.o_proj.weight", "vision_model.positional_embedding.weight",
            "vision_model.class_embedding.weight", "vision_model.tile_embedding_post.weight",
            "vision_model.multi_modal_projector.weight", "vision_model.layernorm_pre.weight"} <= names
    assert not [n for n in names if re.search(r"(_gate|\.gate|gate_attn|gate_ffn|fc1|fc2|self_attn|cross_attn)\b", n)]
    for name in ("vision_model.multi_modal_projector.weight", "vision_model.positional_embedding.weight",
                 "vision_model.class_embedding.weight", "vision_model.tile_embedding_post.weight"):
        assert header[name]["dtype"] == "BF16"
    assert header["text_model.layers.0.attn.q_proj.weight"]["dtype"] == "S3D8"


def test_round_trip_equals_the_packed_model(packed, sqt_file):
    f = read_sqt(sqt_file)
    reader = CheckpointReader(packed["file"])
    fmt = formats.get("s3d8")
    shapes = json.loads(reader.metadata()["shapes"])
    gates = {standard_name(k): v for k, v in packed["gates"].items()}
    folded = {"text_model.layers.1.attn.o_proj.weight": "text_model.layers.1.cross_attn_attn_gate",
              "text_model.layers.1.mlp.down_proj.weight": "text_model.layers.1.cross_attn_mlp_gate",
              "vision_model.layers1.0.attn.o_proj.weight": "vision_model.layers1.0.gate_attn",
              "vision_model.layers1.0.mlp.down_proj.weight": "vision_model.layers1.0.gate_ffn"}
    checked = 0
    for base, shape in shapes.items():
        name = standard_name(base)
        parts = {s: reader.get(f"{base}.{s}") for s in fmt.suffixes}
        if f.entries.get(name) is None or f.entries[name].dtype != "S3D8":
            continue
        entry = f.entries[name]
        assert f.raw(entry).tolist() == parts["packed"].tolist(), "packed bytes kept verbatim"
        assert torch.equal(f.raw(entry.table).reshape(32, 3), parts["table"])
        if name in folded:
            g = torch.tanh(torch.tensor(gates[folded[name]], dtype=torch.bfloat16).float())
            scale = (parts["scale"].float() * g).to(torch.bfloat16)
            assert torch.equal(f.tensor(name), fmt.unpack({**parts, "scale": scale}, shape))
            torch.testing.assert_close(f.tensor(name), fmt.unpack(parts, shape) * g, rtol=2 ** -8, atol=0)
        else:
            assert torch.equal(f.tensor(name), fmt.unpack(parts, shape)), name
        checked += 1
    assert checked >= 35
    # a plain tensor is stored as bf16, equal to the packed file's
    assert torch.equal(f.tensor("text_model.norm.weight"), reader.get("language_model.model.norm.weight"))
    # the global layer's down_proj bias carries its gate
    g = torch.tanh(torch.tensor(gates["vision_model.layers1.0.gate_ffn"], dtype=torch.bfloat16).float())
    bias = reader.get("vision_model.global_transformer.layers.0.mlp.fc2.bias").float()
    assert torch.equal(f.tensor("vision_model.layers1.0.mlp.down_proj.bias"), (bias * g).to(torch.bfloat16))


def test_vision_merges_and_projector(packed, sqt_file):
    f = read_sqt(sqt_file)
    reader = CheckpointReader(packed["file"])
    fmt = formats.get("s3d8")
    shapes = json.loads(reader.metadata()["shapes"])
    cfg = json.loads((packed["teacher"] / "config.json").read_text())["vision_config"]
    d, tiles = cfg["hidden_size"], cfg["max_num_tiles"]
    patches = (cfg["image_size"] // cfg["patch_size"]) ** 2

    def dense(name):
        if f"{name}.packed" in reader.keys():
            return fmt.unpack({s: reader.get(f"{name}.{s}") for s in fmt.suffixes}, shapes[name])
        return reader.get(name).float()

    proj = dense("multi_modal_projector.weight")
    taps = len(cfg["intermediate_layers_indices"])
    got = f.tensor("vision_model.multi_modal_projector.weight")
    assert got.shape == (taps + 1, proj.shape[0], d)
    assert torch.equal(got[-1], proj[:, :d].to(torch.bfloat16))
    for t in range(taps):   # tap t of feature j sits at column d + j * taps + t
        assert torch.equal(got[t], proj[:, d + t::taps].to(torch.bfloat16))
    tanh = lambda k: torch.tanh(dense(k).reshape(-1)[0])  # noqa: E731
    e0 = dense("vision_model.gated_positional_embedding.embedding")
    gate = tanh("vision_model.gated_positional_embedding.gate")
    tile = dense("vision_model.gated_positional_embedding.tile_embedding.weight")[1:].reshape(-1, tiles, patches + 1, d)
    e0 = e0 * (1 - gate) + tile * gate
    pre = dense("vision_model.pre_tile_positional_embedding.embedding.weight")[1:].reshape(-1, tiles, d)
    pos = pre.unsqueeze(2) * tanh("vision_model.pre_tile_positional_embedding.gate") + e0[:, :, 1:]
    assert torch.equal(f.tensor("vision_model.positional_embedding.weight"), pos.to(torch.bfloat16))
    cls = dense("vision_model.class_embedding") + e0[:, :, 0]
    assert torch.equal(f.tensor("vision_model.class_embedding.weight"), cls.to(torch.bfloat16))
    post = dense("vision_model.post_tile_positional_embedding.embedding.weight")[1:].reshape(-1, tiles, d)
    assert torch.equal(f.tensor("vision_model.tile_embedding_post.weight"),
                       (post * tanh("vision_model.post_tile_positional_embedding.gate")).to(torch.bfloat16))


def test_metadata_config_and_vocab(packed, sqt_file):
    meta = read_sqt(sqt_file).metadata
    cfg = json.loads((packed["teacher"] / "config.json").read_text())
    text, vision = meta["config"]["text"], meta["config"]["vision"]
    tc = cfg["text_config"]
    assert text["d_layers"] == tc["num_hidden_layers"] and text["d_vocab"] == tc["vocab_size"]
    assert text["d_attention_kv"] == tc["num_key_value_heads"]
    assert text["d_attention_q"] == tc["num_attention_heads"] // tc["num_key_value_heads"]
    assert text["cross_attention_layers"] == tc["cross_attention_layers"] and text["tied_embeddings"] is False
    head = tc["hidden_size"] // tc["num_attention_heads"]
    theta = tc["rope_parameters"]["rope_theta"]
    assert text["rope_angular_frequency"] == pytest.approx([theta ** (-2 * i / head) for i in range(head // 2)], rel=1e-6)
    assert vision["d_layers0"] == 2 and vision["d_layers1"] == 1 and vision["output_taps"] == [0, 1]
    assert len(vision["image_mean"]) == 3
    vocab = meta["vocab"]
    tok = json.loads((packed["teacher"] / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert vocab["begin_of_text_id"] == added["<|begin_of_text|>"] and vocab["eot_id"] == added["<|eot_id|>"]
    assert vocab["start_header_id"] == added["<|start_header_id|>"]
    assert vocab["image_id"] == added["<|image|>"] == len(vocab["vocab"]) - 1
    assert vocab["stop_token_ids"] == sorted(set(vocab["stop_token_ids"])) and vocab["eot_id"] in vocab["stop_token_ids"]
    assert vocab["chat_template"] == (REPO / "pipeline" / "toy" / "chat_template.jinja").read_text()
    assert all(vocab["vocab"][i] == t for t, i in tok["model"]["vocab"].items())
    assert len(vocab["merges"]) == len(set(vocab["merges"])) and vocab["merges"][0] == "".join(tok["model"]["merges"][0])


def test_directory_input_and_tokenizer_lookup(packed, tmp_path):
    model_dir = tmp_path / "qat"
    model_dir.mkdir()
    shutil.copy(packed["file"], model_dir / "model.safetensors")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "processor_config.json", "generation_config.json"):
        shutil.copy(packed["teacher"] / name, model_dir / name)
    a, b = tmp_path / "a.sqt", tmp_path / "b.sqt"
    export(model_dir, a)
    export(packed["file"], b, tokenizer=str(packed["teacher"]))
    fa, fb = read_sqt(a), read_sqt(b)
    assert fa.metadata["vocab"] == fb.metadata["vocab"] and fa.metadata["config"] == fb.metadata["config"]
    assert {n: e.to_json() for n, e in fa.entries.items()} == {n: e.to_json() for n, e in fb.entries.items()}
    # without a tokenizer anywhere: one clear error
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(packed["file"], lone / "model.safetensors")
    meta = CheckpointReader(lone / "model.safetensors").metadata()
    tensors = {k: CheckpointReader(lone / "model.safetensors").get(k) for k in CheckpointReader(lone / "model.safetensors").keys()}
    write_tensors(lone / "x.safetensors", tensors, {**meta, "source_model": str(tmp_path / "nowhere")})
    with pytest.raises(SqtError, match=r"x\.safetensors: no tokenizer found .*--tokenizer"):
        export(lone / "x.safetensors", tmp_path / "c.sqt")
    assert not (tmp_path / "c.sqt").exists()


def test_vocab_block_needs_the_llama3_special_tokens(packed, tmp_path):
    tok = json.loads((packed["teacher"] / "tokenizer.json").read_text())
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["content"] != "<|eot_id|>"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    shutil.copy(packed["teacher"] / "chat_template.jinja", tmp_path)
    with pytest.raises(SqtUnsupported, match=r"tokenizer\.json: vocab: the reference engine builds Llama 3 chat "
                                             r"prompts and this tokenizer has no <\|eot_id\|>"):
        vocab_block(tmp_path)


def test_vocab_block_reads_a_byte_level_regex_pre_tokenizer(packed, tmp_path):
    """SmolLM2 and GPT-2 split inside the ByteLevel step (use_regex): that pattern is the engine's pre_tokenizer."""
    tok = json.loads((packed["teacher"] / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    shutil.copy(packed["teacher"] / "chat_template.jinja", tmp_path)
    assert vocab_block(tmp_path)["pre_tokenizer"] == GPT2_PATTERN
    tokenizers, regex = pytest.importorskip("tokenizers"), pytest.importorskip("regex")
    text = "It's 2026, isn't it?  Yes\n\tok  "
    pieces = tokenizers.pre_tokenizers.ByteLevel(use_regex=True, add_prefix_space=False).pre_tokenize_str(text)
    decode = tokenizers.decoders.ByteLevel().decode
    assert [decode([p]) for p, _ in pieces] == regex.findall(GPT2_PATTERN, text)
    tok["pre_tokenizer"] = {"type": "ByteLevel", "use_regex": False}       # no pattern anywhere: refused
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(SqtError, match=r"vocab\.pre_tokenizer: expected one split pattern"):
        vocab_block(tmp_path)


def _rewrite(src, dst, edit=None, magic=MAGIC, version=VERSION, shift=0):
    """Copy a .sqt file with its header edited (``edit(header)``), re-padded to the alignment."""
    raw = src.read_bytes()
    n = struct.unpack("<Q", raw[8:16])[0]
    header = json.loads(raw[16:16 + n])
    if edit:
        edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((-(16 + len(text)) % 32) + shift)
    dst.write_bytes(magic + struct.pack("<I", version) + struct.pack("<Q", len(text)) + text + raw[16 + n:])
    return dst


def _drop(path_keys):
    def edit(header):
        obj = header
        for k in path_keys[:-1]:
            obj = obj[k]
        del obj[path_keys[-1]]
    return edit


def _misalign(header):
    e = header["text_model.norm.weight"]
    b, end = e["data_offsets"]
    e["data_offsets"] = [b + 2, end + 2]


def _wrong_bytes(header):
    e = header["text_model.layers.0.attn.q_proj.weight"]
    e["shape"] = [e["shape"][0], e["shape"][1] + 16]


def _unfolded_gate(header):
    header["text_model.layers.1.cross_attn_attn_gate"] = header.pop("text_model.layers.1.attn.q_norm.weight")


def _no_scale(header):
    del header["text_model.layers.0.attn.q_proj.weight"]["scale"]


def _bad_table(header):
    header["text_model.layers.0.attn.q_proj.weight"]["table"]["shape"] = [96, 1]     # same bytes, wrong shape


def _unsorted_stops(header):
    header["__metadata__"]["vocab"]["stop_token_ids"] = [9, 1]


@pytest.mark.parametrize("kwargs, field", [
    ({"magic": b"GGUF"}, r"magic: expected b'\.sqt'"),
    ({"version": 2}, r"version: 2, the engine reads version 3 only"),
    ({"shift": 1}, r"header length: 16 \+ \d+ is not a multiple of the alignment 32"),
    ({"edit": _misalign}, r"tensor 'text_model\.norm\.weight'\.data_offsets: begin \d+ is not a multiple of the alignment 32"),
    ({"edit": _drop(["__metadata__", "vocab", "eot_id"])}, r"__metadata__\.vocab\.eot_id: missing"),
    ({"edit": _drop(["__metadata__", "vocab", "image_id"])}, r"__metadata__\.vocab\.image_id: missing"),
    ({"edit": _drop(["__metadata__", "config", "text", "d_mlp"])}, r"__metadata__\.config\.text\.d_mlp: missing"),
    ({"edit": _drop(["__metadata__", "created"])}, r"__metadata__\.created: missing"),
    ({"edit": _drop(["text_model.layers.2.mlp.up_proj.weight"])}, r"tensor 'text_model\.layers\.2\.mlp\.up_proj\.weight': missing"),
    ({"edit": _wrong_bytes}, r"tensor '.*q_proj\.weight'\.data_offsets: .* holds \d+ bytes, a S3D8 tensor of shape"),
    ({"edit": _unfolded_gate}, r"tensor 'text_model\.layers\.1\.cross_attn_attn_gate': not a tensor the engine reads"),
    ({"edit": _no_scale}, r"tensor '.*q_proj\.weight'\.scale: missing"),
    ({"edit": _bad_table}, r"tensor '.*q_proj\.weight'\.table: expected INT8 \[32, 3\]"),
    ({"edit": _unsorted_stops}, r"__metadata__\.vocab\.stop_token_ids: expected a non-empty sorted list"),
])
def test_bad_files_name_the_file_and_the_field(sqt_file, tmp_path, kwargs, field):
    bad = _rewrite(sqt_file, tmp_path / "bad.sqt", **kwargs)
    with pytest.raises(SqtError, match=r"bad\.sqt: " + field):
        read_sqt(bad)


def test_buffer_checks_and_cli(sqt_file, tmp_path):
    good = _rewrite(sqt_file, tmp_path / "good.sqt")
    read_sqt(good)
    raw = bytearray(good.read_bytes())
    f = read_sqt(good, check_data=False)
    e = f.entries["text_model.layers.0.attn.q_proj.weight"]
    raw[f.data_start + e.table.begin] = 0xFF              # centroid -1
    (tmp_path / "table.sqt").write_bytes(raw)
    with pytest.raises(SqtError, match=r"table\.sqt: tensor 'text_model\.layers\.0\.attn\.q_proj\.weight'\.table: centroids"):
        read_sqt(tmp_path / "table.sqt")
    raw = bytearray(good.read_bytes())
    end = min(p.end for e in f.entries.values() for p in e.parts() if p.end % 32)
    raw[f.data_start + end] = 1                            # a byte of the padding after a tensor
    (tmp_path / "pad.sqt").write_bytes(raw)
    with pytest.raises(SqtError, match=rf"pad\.sqt: buffer: bytes \[{end}, \d+\) before tensor '.*' are not zero"):
        read_sqt(tmp_path / "pad.sqt")
    run = lambda *a: subprocess.run([sys.executable, "-m", "pipeline.sqt.write", *a], capture_output=True, text=True,  # noqa: E731
                                    cwd=REPO)
    ok = run("check", str(good))
    assert ok.returncode == 0 and "version 3" in ok.stdout and "OK" in ok.stdout
    bad = run("check", str(tmp_path / "pad.sqt"))
    assert bad.returncode == 1 and "pad.sqt: buffer" in bad.stderr and "Traceback" not in bad.stderr


def test_only_s3d8_packed_models_export(packed, tmp_path):
    states = fit_all(packed["teacher"], "int")
    out = tmp_path / "int.safetensors"
    write_packed(out, CheckpointReader(packed["teacher"]), formats.get("int"), states,
                 metadata={"source_model": str(packed["teacher"])})
    with pytest.raises(SqtError, match=r"int\.safetensors: metadata 'format' is 'int'"):
        export(out, tmp_path / "x.sqt")


def test_export_stage_writes_the_files_or_says_why_not(packed, tmp_path, monkeypatch):
    """Stage export-sqt: each student's .sqt (read back); a model the engine cannot run leaves NOT-EXPORTED.txt with
    the reason, and no .sqt."""
    import stages.export_sqt as stage
    from pipeline.sqt.blocks import SqtUnsupported

    root = tmp_path / "packed"
    for method in ("direct-cast", "qat"):
        d = root / method
        d.mkdir(parents=True)
        shutil.copy(packed["file"], d / "model.safetensors")
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                     "processor_config.json", "generation_config.json"):
            shutil.copy(packed["teacher"] / name, d / name)
    stage.main(["--packed", str(root), "--out", str(tmp_path / "sqt")])
    assert sorted(p.name for p in (tmp_path / "sqt").iterdir()) == ["s3d8-direct-cast.sqt", "s3d8-qat.sqt"]

    def refuse(model, target, **_):
        raise SqtUnsupported(f"{model}: vocab: no Llama 3 chat tokens")
    monkeypatch.setattr(stage, "export", refuse)
    stage.main(["--packed", str(root), "--out", str(tmp_path / "sqt")])
    assert [p.name for p in (tmp_path / "sqt").iterdir()] == ["NOT-EXPORTED.txt"]
    assert "no Llama 3 chat tokens" in (tmp_path / "sqt" / "NOT-EXPORTED.txt").read_text()
