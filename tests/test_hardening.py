"""Issue 12: every malformed packed file, teacher shard or image reference ends in one clear
ValueError / FileNotFoundError naming the file and the tensor or field; never a hang, a traceback
from deep inside, or a silently wrong model."""

from __future__ import annotations

import json
import os
import resource
import signal
import struct
from contextlib import contextmanager

import pyarrow as pa
import pytest
import torch
from PIL import Image

from pipeline import formats
from pipeline.packed.checkpoint import CheckpointReader
from pipeline.teacher.images import load_image
from pipeline.models import load_model
from pipeline.packed.file import load_packed_model, write_packed
from pipeline.teacher.answers import collate, Example, load_examples
from pipeline.files.shards import write_shard
from tests.conftest import tiny_inputs
from tests.test_packed import fit_all

VICTIM = "language_model.model.layers.0.mlp.up_proj.weight"
NORM = "language_model.model.norm.weight"


# --- raw safetensors editing --------------------------------------------------------------------------------

def split(path) -> tuple[dict, bytes]:
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def join(path, header: dict, body: bytes) -> None:
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    open(path, "wb").write(struct.pack("<Q", len(blob)) + blob + body)


def edited(src, dst, *, meta=None, header=None, tensor=None):
    """A copy of ``src`` with its metadata updated (``meta``: {key: value or None to drop}), its header
    edited in place (``header(h)``), or one tensor's bytes rewritten (``tensor = (name, fn(bytes) -> bytes)``)."""
    h, body = split(src)
    if meta:
        m = h.setdefault("__metadata__", {})
        for k, v in meta.items():
            if v is None:
                m.pop(k, None)
            else:
                m[k] = v
    if header:
        header(h)
    if tensor:
        name, fn = tensor
        start, end = h[name]["data_offsets"]
        new = fn(body[start:end])
        assert len(new) == end - start
        body = body[:start] + new + body[end:]
    join(dst, h, body)
    return dst


@contextmanager
def deadline(seconds: int):
    def fail(*_):
        raise TimeoutError(f"no answer within {seconds} s")
    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def good(tiny_checkpoint, tmp_path_factory):
    """A valid S3D8 packed file of the tiny model (bf16 unquantised tensors, as the stage writes)."""
    states = fit_all(tiny_checkpoint, "s3d8")
    out = tmp_path_factory.mktemp("hardening") / "good.safetensors"
    teacher = load_model(str(tiny_checkpoint), torch.float32)
    write_packed(out, CheckpointReader(tiny_checkpoint), formats.get("s3d8"), states,
                 metadata={"config": teacher.config.to_dict()})
    return out


def fails(path, match, exc=ValueError, **kw):
    with deadline(60):
        with pytest.raises(exc, match=match) as info:
            load_packed_model(path, **kw)
    assert str(path.name) in str(info.value) or str(path) in str(info.value)
    return str(info.value)


# --- files ---------------------------------------------------------------------------------------------------

def test_the_good_file_loads(good):
    model = load_packed_model(good)
    with torch.no_grad():
        assert torch.isfinite(model(**tiny_inputs()).logits).all()


def test_not_a_regular_file(tmp_path):
    fails(tmp_path / "absent.safetensors", "not found", FileNotFoundError)
    fails(tmp_path, "model.safetensors", FileNotFoundError)        # a directory without model.safetensors
    (tmp_path / "model.safetensors").mkdir()
    fails(tmp_path, "directory")                                   # ... whose model.safetensors is a directory
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    fails(fifo, "not a regular file")                              # refused without opening: no hang


def test_truncated_and_garbage(good, tmp_path):
    data = good.read_bytes()
    for name, blob in [("cut.safetensors", data[:-100]), ("header.safetensors", data[:50]),
                       ("empty.safetensors", b""), ("huge.safetensors", struct.pack("<Q", 2 ** 62) + data[8:])]:
        (tmp_path / name).write_bytes(blob)
        fails(tmp_path / name, "not a readable safetensors file")


def test_index_pointing_outside_the_directory(good, tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {NORM: "../x.safetensors"}}))
    fails(tmp_path, "outside the checkpoint directory")
    (tmp_path / "model.safetensors.index.json").write_text("[1, 2")
    fails(tmp_path, "not a checkpoint index")


# --- metadata ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, match", [
    ("[1, 2, 3]", "'config' must be a JSON object"),
    ("{not json", "'config' is not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, "'config' is nested too deeply"),
    ('{"a": ' * 50_000 + "1" + "}" * 50_000, "'config' is nested too deeply"),
    ("{}", "'config' has no 'model_type'"),
    ('{"model_type": "no-such-model"}', "'config' is not a valid model config"),
])
def test_bad_config(good, tmp_path, value, match):
    fails(edited(good, tmp_path / "c.safetensors", meta={"config": value}), match)


def test_config_cannot_allocate_before_validation(good, tmp_path):
    """A 20M-token vocabulary would allocate gigabytes if the model were built before the check."""
    cfg = json.loads(split(good)[0]["__metadata__"]["config"])
    cfg["text_config"]["vocab_size"] = 20_000_000
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    msg = fails(edited(good, tmp_path / "v.safetensors", meta={"config": json.dumps(cfg)}), "shape")
    assert "embed_tokens" in msg or "lm_head" in msg
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000     # KiB: no 4 GB table
    cfg["text_config"]["vocab_size"] = 60
    cfg["text_config"]["num_hidden_layers"] = 10 ** 7
    fails(edited(good, tmp_path / "l.safetensors", meta={"config": json.dumps(cfg)}), "num_hidden_layers")
    cfg["text_config"]["num_hidden_layers"] = -3
    fails(edited(good, tmp_path / "n.safetensors", meta={"config": json.dumps(cfg)}), "config")


@pytest.mark.parametrize("value, match", [
    ("[[64, 48]]", "'shapes' must be a JSON object"),
    ("{bad", "'shapes' is not valid JSON"),
    (json.dumps({VICTIM: 64}), "'shapes' entry"),
    (json.dumps({VICTIM: [64, 48.0]}), "'shapes' entry"),
    (json.dumps({VICTIM: [64, True]}), "'shapes' entry"),
    (json.dumps({VICTIM: [48, 64]}), "logical shape"),
    (json.dumps({"nonexistent.weight": [3, 3]}), "nonexistent.weight"),
])
def test_bad_shapes(good, tmp_path, value, match):
    shapes = json.loads(split(good)[0]["__metadata__"]["shapes"])
    if value.startswith("{\"") and "nonexistent" in value:
        shapes.update(json.loads(value))
        value = json.dumps(shapes)
    fails(edited(good, tmp_path / "s.safetensors", meta={"shapes": value}), match)


@pytest.mark.parametrize("meta, match", [
    ({"format": None}, "'format'"), ({"format": "bf16"}, "'format'"), ({"format_version": "9"}, "'format_version'"),
    ({"layout": "other"}, "'layout'"), ({"llama_mobile_format": "x"}, "'llama_mobile_format'"),
    ({"config": None}, "no model config"),
])
def test_bad_format_fields(good, tmp_path, meta, match):
    fails(edited(good, tmp_path / "f.safetensors", meta=meta), match)


# --- tensors -------------------------------------------------------------------------------------------------

def relabel(name, dtype):
    def fn(h):
        h[name]["dtype"] = dtype
    return fn


def reshape(name, shape):
    def fn(h):
        h[name]["shape"] = shape
    return fn


@pytest.mark.parametrize("edit, name", [
    (relabel(f"{VICTIM}.scale", "F16"), f"{VICTIM}.scale"),          # bf16 bytes relabelled F16
    (relabel(f"{VICTIM}.table", "U8"), f"{VICTIM}.table"),           # int8 relabelled uint8
    (relabel(f"{VICTIM}.packed", "I8"), f"{VICTIM}.packed"),
    (relabel(NORM, "F16"), NORM),                                    # one plain tensor relabelled
    (relabel(NORM, "I16"), NORM),
    (reshape(f"{VICTIM}.packed", [22, 48]), f"{VICTIM}.packed"),     # same bytes, 2-D: not the SPEC layout
    (reshape(f"{VICTIM}.scale", [64]), f"{VICTIM}.scale"),
    (reshape(f"{VICTIM}.table", [3, 32]), f"{VICTIM}.table"),
    (reshape(NORM, [1, 48]), NORM),                                  # a plain tensor of the wrong shape
])
def test_dtype_and_shape_against_the_spec(good, tmp_path, edit, name):
    msg = fails(edited(good, tmp_path / "t.safetensors", header=edit), "dtype|shape")
    assert repr(name) in msg


def bf16_bytes(values):
    return torch.tensor(values, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, -0.5])
def test_bad_scales_are_refused(good, tmp_path, bad):
    def fn(raw):
        return bf16_bytes([bad]) + raw[2:]
    msg = fails(edited(good, tmp_path / "s.safetensors", tensor=(f"{VICTIM}.scale", fn)), "finite and > 0")
    assert f"{VICTIM}.scale" in msg


@pytest.mark.parametrize("decode", ["eager", "lazy"])
def test_all_zero_row_scales_are_valid(good, tmp_path, decode):
    """SPEC section 1: an all-zero row's scale is 2^-126 (reference) or 1 (the old convention): both load."""
    for value in (2.0 ** -126, 1.0):
        path = edited(good, tmp_path / "z.safetensors", tensor=(f"{VICTIM}.scale", lambda raw: bf16_bytes([value]) + raw[2:]))
        model = load_packed_model(path, decode=decode)
        assert model is not None


def test_packed_byte_table_values_out_of_range(good, tmp_path):
    path = edited(good, tmp_path / "t.safetensors", tensor=(f"{VICTIM}.table", lambda raw: b"\xff" + raw[1:]))
    for decode in ("eager", "lazy"):
        msg = fails(path, "table", decode=decode)
        assert VICTIM in msg


def test_plain_tensor_nan_and_foreign_tensors(good, tmp_path):
    path = edited(good, tmp_path / "n.safetensors", tensor=(NORM, lambda raw: bf16_bytes([float("nan")]) + raw[2:]))
    assert NORM in fails(path, "finite")

    def add_tensor(h):                     # a tensor of no module, squeezed in before the first
        h["extra.weight"] = {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
    assert "extra.weight" in fails(edited(good, tmp_path / "x.safetensors", header=add_tensor), "does not belong")

    def drop(h):
        h.pop(f"{VICTIM}.table")
    # removing a header entry leaves bytes no tensor covers: refused by safetensors itself
    fails(edited(good, tmp_path / "d.safetensors", header=drop), "safetensors|missing")


def test_non_persistent_buffers_equal_the_eager_model(good, tiny_checkpoint):
    model = load_packed_model(good)
    teacher = load_model(str(tiny_checkpoint), torch.float32)
    for (name, a), (_, b) in zip(model.named_buffers(), teacher.named_buffers()):
        if name.endswith("inv_freq"):
            assert torch.equal(a, b), name
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


# --- teacher shards --------------------------------------------------------------------------------------------

def shard(tmp_path, rows, name="shard-00000.parquet"):
    d = tmp_path / "teacher"
    d.mkdir(exist_ok=True)
    write_shard(d / name, pa.Table.from_pylist(rows), {"test": True})
    return d


def row(prompt=(5, 6, 7), response=(8, 1), index=0):
    return {"index": index, "image_ref": "toy:0:0", "prompt_ids": list(prompt), "response_ids": list(response)}


def test_good_shard_loads(tmp_path):
    d = shard(tmp_path, [row(index=1), row(index=0)])
    assert [e.index for e in load_examples(d)] == [0, 1]
    assert len(load_examples(d, vocab_size=60)) == 2


@pytest.mark.parametrize("bad, vocab, match", [
    (row(prompt=(5, 60, 7)), 60, r"prompt_ids\[1\] = 60 is outside the vocabulary \[0, 60\)"),
    (row(response=(8, 99)), 60, r"response_ids\[1\] = 99"),
    (row(prompt=(5, -1)), None, r"prompt_ids\[1\] = -1 is outside"),
    (row(prompt=()), None, "prompt_ids is empty"),
])
def test_bad_token_ids_name_the_shard(tmp_path, bad, vocab, match):
    d = shard(tmp_path, [row(index=1), {**bad, "index": 0}])
    with pytest.raises(ValueError, match=match) as info:
        load_examples(d, vocab_size=vocab)
    assert "shard-00000.parquet" in str(info.value)


def test_non_integer_token_ids(tmp_path):
    d = shard(tmp_path, [{"index": 0, "image_ref": "toy:0:0", "prompt_ids": [5.0, 6.5], "response_ids": [1.0]}])
    with pytest.raises(ValueError, match=r"shard-00000.parquet.*prompt_ids\[0\] = 5.0 is not a whole-number"):
        load_examples(d)
    with pytest.raises(ValueError, match="vocab_size"):
        load_examples(d, vocab_size=0)


def test_collate_refuses_an_empty_prompt():
    with pytest.raises(ValueError, match="prompt 3: prompt_ids is empty"):
        collate([Example(3, "toy:0:0", (), (1,))], processor=None, max_seq_len=16)


# --- image references ----------------------------------------------------------------------------------------------

def test_file_refs_stay_inside_the_pool(tmp_path):
    pool = tmp_path / "pool"
    (pool / "a").mkdir(parents=True)
    Image.new("RGB", (4, 4)).save(pool / "a" / "x.png")
    Image.new("RGB", (4, 4)).save(tmp_path / "secret.png")
    os.symlink(tmp_path / "secret.png", pool / "link.png")
    spec = f"folder:{pool}"
    assert load_image(f"file:{pool}/a/x.png", spec).size == (4, 4)
    assert load_image(f"file:{tmp_path}/secret.png").size == (4, 4)        # no pool: today's behaviour
    for ref in (f"file:{tmp_path}/secret.png", f"file:{pool}/a/../../secret.png", f"file:{pool}/link.png",
                "toy:0:0", "hf:other:train:image:0"):
        with pytest.raises(ValueError, match="outside the image pool"):
            load_image(ref, spec)


def test_hf_and_generated_refs_stay_inside_the_pool():
    with pytest.raises(ValueError, match="outside the image pool"):
        load_image("hf:evil/set:train:image:0", "hf:good/set")
    with pytest.raises(ValueError, match="outside the image pool"):
        load_image("hf:good/set:test:image:0", "hf:good/set")             # another split
    with pytest.raises(ValueError, match="expected hf:DATASET:SPLIT:COLUMN:INDEX"):
        load_image("hf:good/set:train:-1", "hf:good/set")
    pytest.importorskip("pipeline.toy")
    import pipeline.toy  # noqa: F401  registers the toy pool
    assert load_image("toy:0:0", "toy").mode == "RGB"
    with pytest.raises(ValueError, match="outside the image pool"):
        load_image(f"file:/etc/passwd", "toy")
