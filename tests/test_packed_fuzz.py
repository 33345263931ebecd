"""Fuzzing the packed-file loader (issue 12): mutated headers, offsets, dtypes, shapes, metadata and bytes
of a small valid packed file give a clear ValueError / FileNotFoundError naming the file, or a model
that is correct: never another exception, a hang or a silently wrong answer.

The oracle: where a mutation leaves the tensors and the model config alone (metadata fields, tensor
headers, the header's framing), a file that still loads must give the reference logits bit for bit.
Where it changes tensor bytes or the config, the file may be a valid file of another model, so a
model that loads only has to run. ``S3D8_FUZZ_EXAMPLES`` scales the number of cases (default: the
suite's budget, well under a minute); runs are derandomised so CI is reproducible.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pipeline import formats  # noqa: E402
from pipeline.packed.checkpoint import CheckpointReader  # noqa: E402
from pipeline.models import load_model  # noqa: E402
from pipeline.packed.file import load_packed_model, write_packed  # noqa: E402
from tests.conftest import tiny_inputs  # noqa: E402
from tests.test_hardening import deadline  # noqa: E402
from tests.test_packed import fit_all  # noqa: E402

SCALE = float(os.environ.get("S3D8_FUZZ_EXAMPLES", "1"))
FUZZ = settings(max_examples=1, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
TRIED = {"cases": 0, "refused": 0, "loaded": 0}
DTYPES = ["F32", "F16", "BF16", "F64", "I8", "U8", "I16", "I32", "I64", "BOOL", "F8_E4M3", "F8_E5M2", "U16",
          "U32", "U64", "X", ""]


def examples(n: int) -> settings:
    return settings(FUZZ, max_examples=max(1, int(n * SCALE)))


@pytest.fixture(scope="module")
def valid(tiny_checkpoint, tmp_path_factory):
    """(file bytes, header dict, body bytes, reference logits) of a valid S3D8 packed file."""
    states = fit_all(tiny_checkpoint, "s3d8")
    out = tmp_path_factory.mktemp("fuzz") / "valid.safetensors"
    teacher = load_model(str(tiny_checkpoint), torch.float32)
    write_packed(out, CheckpointReader(tiny_checkpoint), formats.get("s3d8"), states, dtype=torch.float32,
                 metadata={"config": teacher.config.to_dict()})
    data = out.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    with torch.no_grad():
        reference = load_packed_model(out)(**tiny_inputs()).logits
    return Valid((data, header, data[8 + n:], reference))


class Valid(tuple):
    def __repr__(self) -> str:       # hypothesis prints the arguments of a failing case
        return "<valid packed file>"


def frame(header: dict, body: bytes) -> bytes:
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob + body


def check(data: bytes, reference: torch.Tensor, *, same_model: bool) -> None:
    """Load ``data`` as a packed file: a clear error naming the file, or a model (equal to the reference
    when ``same_model``)."""
    TRIED["cases"] += 1
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "mutant.safetensors"
        path.write_bytes(data)
        try:
            with deadline(30):
                model = load_packed_model(path)
        except (ValueError, FileNotFoundError) as e:
            TRIED["refused"] += 1
            assert str(path) in str(e), f"the error does not name the file: {e}"
            assert "\n" not in str(e)[:300] or "Traceback" not in str(e)
            return
        TRIED["loaded"] += 1
        if not same_model:
            return
        with torch.no_grad():
            logits = model(**tiny_inputs()).logits
        assert torch.equal(logits, reference), "the file loaded but gives another answer"


# --- strategies ------------------------------------------------------------------------------------------------

json_values = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                           max_leaves=12)
shape_values = st.lists(st.integers(-3, 2 ** 40) | st.sampled_from([0, 1, 3, 16, 32, 48, 64, 96, 1056]), max_size=4)


@given(data=st.data())
@examples(100)
def test_fuzz_tensor_headers(valid, data):
    """dtype, shape and data_offsets of one tensor; entries renamed, dropped or added."""
    raw, header, body, reference = valid
    header = json.loads(json.dumps(header))
    names = sorted(k for k in header if k != "__metadata__")
    name = data.draw(st.sampled_from(names), "tensor")
    what = data.draw(st.sampled_from(["dtype", "shape", "offsets", "rename", "drop", "add", "swap"]), "what")
    entry = header[name]
    if what == "dtype":
        entry["dtype"] = data.draw(st.sampled_from(DTYPES))
    elif what == "shape":
        entry["shape"] = data.draw(shape_values)
    elif what == "offsets":
        entry["data_offsets"] = data.draw(st.lists(st.integers(-5, len(body) + 64), min_size=0, max_size=3))
    elif what == "rename":
        new = data.draw(st.sampled_from(names) | st.text(max_size=30) | st.just(name + ".packed") |
                        st.just(name.rpartition(".")[0] + ".codes"))
        header[new] = header.pop(name)
    elif what == "drop":
        del header[name]
    elif what == "add":
        header[data.draw(st.text(min_size=1, max_size=20))] = {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
    else:  # swap two entries' headers (the bytes go with other names)
        other = data.draw(st.sampled_from(names))
        header[name], header[other] = header[other], header[name]
        if (header[name]["dtype"], header[name]["shape"]) == (header[other]["dtype"], header[other]["shape"]):
            # two tensors of one dtype and shape exchanged (two centroid tables): a valid file of another
            # model, which no reader can tell from the original; it only has to load and run
            check(frame(header, body), reference, same_model=False)
            return
    # every other header edit either leaves each tensor's (name, dtype, shape, bytes) as they were, or
    # must be refused
    check(frame(header, body), reference, same_model=True)


@given(data=st.data())
@examples(100)
def test_fuzz_metadata(valid, data):
    """Metadata fields replaced by arbitrary JSON or text, dropped, or edited in place (shapes, config)."""
    raw, header, body, reference = valid
    header = json.loads(json.dumps(header))
    meta = header["__metadata__"]
    key = data.draw(st.sampled_from(sorted(meta) + ["unknown_key"]), "key")
    how = data.draw(st.sampled_from(["json", "text", "drop", "edit"]), "how")
    same_model = key != "config"
    if how == "json":
        meta[key] = json.dumps(data.draw(json_values))
    elif how == "text":
        meta[key] = data.draw(st.text(max_size=40) | st.sampled_from(["[" * 5000, "{" * 3000, "null", "1e999"]))
    elif how == "drop":
        meta.pop(key, None)
    elif key == "shapes":
        shapes = json.loads(meta["shapes"])
        victim = data.draw(st.sampled_from(sorted(shapes)))
        shapes[victim] = data.draw(json_values | shape_values)
        meta["shapes"] = json.dumps(shapes)
    elif key == "config":
        cfg = json.loads(meta["config"])
        part = cfg[data.draw(st.sampled_from(["text_config", "vision_config"]))]
        field = data.draw(st.sampled_from(sorted(part)))
        part[field] = data.draw(json_values | st.integers(-1, 10 ** 9))
        meta["config"] = json.dumps(cfg)
    else:
        meta[key] = data.draw(st.text(max_size=12))
    check(frame(header, body), reference, same_model=same_model)


@given(data=st.data())
@examples(80)
def test_fuzz_framing_bytes(valid, data):
    """The 8-byte header length, bytes of the header text, truncation and trailing bytes."""
    raw, header, body, reference = valid
    n = struct.unpack("<Q", raw[:8])[0]
    how = data.draw(st.sampled_from(["length", "header_bytes", "truncate", "append"]), "how")
    if how == "length":
        mutated = struct.pack("<Q", data.draw(st.integers(0, 2 ** 64 - 1) | st.integers(n - 16, n + 16).filter(
            lambda v: v >= 0))) + raw[8:]
    elif how == "header_bytes":
        blob = bytearray(raw[:8 + n])
        for pos, value in data.draw(st.lists(st.tuples(st.integers(8, 8 + n - 1), st.integers(0, 255)),
                                             min_size=1, max_size=4)):
            blob[pos] = value
        mutated = bytes(blob) + raw[8 + n:]
    elif how == "truncate":
        mutated = raw[:data.draw(st.integers(0, len(raw) - 1))]
    else:
        mutated = raw + data.draw(st.binary(min_size=1, max_size=64))
    same_model = how != "header_bytes"    # a byte of the header text may rewrite the config or a name
    check(mutated, reference, same_model=same_model)


@given(data=st.data())
@examples(60)
def test_fuzz_tensor_bytes(valid, data):
    """Bytes of the scales, tables and plain tensors: NaN, Inf, zero, negative scales, out-of-range table
    entries, arbitrary bytes. The result is another model or a refusal, never a crash."""
    raw, header, body, reference = valid
    names = sorted(k for k in header if k != "__metadata__" and header[k]["data_offsets"][1] > header[k]["data_offsets"][0])
    name = data.draw(st.sampled_from([n for n in names if n.endswith((".scale", ".table"))] + names[:20]), "tensor")
    start, end = header[name]["data_offsets"]
    blob = bytearray(body)
    special = {"BF16": [b"\xc0\x7f", b"\x80\x7f", b"\x80\xff", b"\x00\x00", b"\x00\x80", b"\x80\xbf", b"\x80\x00"],
               "F32": [struct.pack("<f", v) for v in (float("nan"), float("inf"), 0.0, -1.0, 1e38)]}
    width = {"BF16": 2, "F32": 4}.get(header[name]["dtype"], 1)
    for _ in range(data.draw(st.integers(1, 3))):
        pos = start + width * data.draw(st.integers(0, (end - start) // width - 1))
        value = data.draw(st.sampled_from(special.get(header[name]["dtype"], [b"\x80", b"\xff", b"\x7f"])) |
                          st.binary(min_size=width, max_size=width))
        blob[pos:pos + width] = value
    check(frame(header, bytes(blob)), reference, same_model=False)


def test_fuzz_count(capsys):
    """How many malformed files the fuzz tests above tried (printed; run with -s to see it)."""
    with capsys.disabled():
        print(f"\npacked-file fuzz: {TRIED['cases']} mutated files tried, {TRIED['refused']} refused with a clear "
              f"error, {TRIED['loaded']} loaded")
