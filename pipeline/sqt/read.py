"""Reading a ``.sqt`` v3 file back and validating it as the engine would load it (SPEC section 9):
:func:`read_sqt` gives a :class:`SqtFile` (metadata, entries, decoded tensors); :func:`summary` is its one-line
report. It needs only :mod:`pipeline.sqt.container`, not the exporter."""

from __future__ import annotations

import datetime
import json
import mmap
import os
import struct
from pathlib import Path

import torch

from pipeline.packed.layout import TABLE_SHAPE
from pipeline.sqt.container import (DTYPES, MAGIC, METADATA_KEYS, PREFIX_BYTES, TEXT_KEYS, VERSION, VISION_KEYS,
                                 VOCAB_KEYS, FORCE_BF16, Entry, SqtError, expected_bytes)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_keys(path, where: str, obj, keys: dict) -> None:
    if not isinstance(obj, dict):
        raise SqtError(f"{path}: {where}: expected a JSON object, got {type(obj).__name__}")
    for key, kind in keys.items():
        if key not in obj:
            raise SqtError(f"{path}: {where}.{key}: missing (the engine requires it)")
        value = obj[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        ok = any((_is_int(value) if k is int else
                  (isinstance(value, (int, float)) and not isinstance(value, bool)) if k is float else
                  isinstance(value, k)) for k in kinds)
        if not ok:
            names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise SqtError(f"{path}: {where}.{key}: expected {names}, got {json.dumps(value)[:60]}")


def _parse_entry(path, name: str, obj, alignment: int, buffer_len: int, where: str | None = None) -> Entry:
    where = where or f"tensor {name!r}"
    if not isinstance(obj, dict):
        raise SqtError(f"{path}: {where}: expected a JSON object")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in obj:
            raise SqtError(f"{path}: {where}.{key}: missing")
    dtype, shape, offsets = obj["dtype"], obj["shape"], obj["data_offsets"]
    if dtype not in DTYPES:
        raise SqtError(f"{path}: {where}.dtype: {str(dtype)[:20]!r} is not one of {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not shape or not all(_is_int(s) and s >= 1 for s in shape):
        raise SqtError(f"{path}: {where}.shape: expected a list of positive integers, got {json.dumps(shape)[:60]}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)):
        raise SqtError(f"{path}: {where}.data_offsets: expected [begin, end] integers, got {json.dumps(offsets)[:60]}")
    begin, end = offsets
    if begin % alignment:
        raise SqtError(f"{path}: {where}.data_offsets: begin {begin} is not a multiple of the alignment {alignment}")
    if not 0 <= begin <= end <= buffer_len:
        raise SqtError(f"{path}: {where}.data_offsets: [{begin}, {end}) is outside the buffer of {buffer_len} bytes")
    if dtype == "S3D8" and len(shape) != 2:
        raise SqtError(f"{path}: {where}.shape: an S3D8 tensor is 2-D [d_out, d_in], got {shape}")
    want = expected_bytes(dtype, tuple(shape))
    if end - begin != want:
        raise SqtError(f"{path}: {where}.data_offsets: [{begin}, {end}) holds {end - begin} bytes, a {dtype} "
                       f"tensor of shape {shape} needs {want}")
    return Entry(dtype, tuple(shape), begin, end)


class SqtFile:
    """A validated ``.sqt`` file: ``metadata``, ``entries`` (name -> :class:`Entry`) and tensor access."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such .sqt file")
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(PREFIX_BYTES)
            if len(prefix) < 8 or prefix[:4] != MAGIC:
                raise SqtError(f"{path}: magic: expected {MAGIC!r} (u32 {struct.unpack('<I', MAGIC)[0]:#x}), "
                               f"got {prefix[:4]!r}")
            (self.version,) = struct.unpack("<I", prefix[4:8])
            if self.version != VERSION:
                raise SqtError(f"{path}: version: {self.version}, the engine reads version {VERSION} only")
            if len(prefix) < PREFIX_BYTES:
                raise SqtError(f"{path}: header length: file ends after {len(prefix)} bytes")
            (n,) = struct.unpack("<Q", prefix[8:16])
            if n > size - PREFIX_BYTES:
                raise SqtError(f"{path}: header length: {n} bytes, but the file has {size - PREFIX_BYTES} after the prefix")
            raw = f.read(n)
        try:
            text = raw.decode("utf-8")
            header = json.loads(text)
        except (UnicodeDecodeError, ValueError) as e:
            raise SqtError(f"{path}: header: not valid UTF-8 JSON ({e})") from None
        if not isinstance(header, dict):
            raise SqtError(f"{path}: header: expected a JSON object")
        stripped = text.rstrip(" ")
        if stripped != text.strip() or "\n" in text[len(stripped):]:
            raise SqtError(f"{path}: header: padding must be spaces after the JSON")
        meta = header.pop("__metadata__", None)
        if meta is None:
            raise SqtError(f"{path}: __metadata__: missing")
        _check_keys(path, "__metadata__", meta, METADATA_KEYS)
        self.alignment = alignment = meta["alignment"]
        if alignment < 1 or alignment & (alignment - 1):
            raise SqtError(f"{path}: __metadata__.alignment: {alignment} is not a positive power of two")
        if (PREFIX_BYTES + n) % alignment:
            raise SqtError(f"{path}: header length: 16 + {n} is not a multiple of the alignment {alignment}")
        try:
            datetime.datetime.fromisoformat(meta["created"])
        except ValueError:
            raise SqtError(f"{path}: __metadata__.created: {meta['created'][:40]!r} is not ISO-8601") from None
        if "comment" in meta and not isinstance(meta["comment"], str):
            raise SqtError(f"{path}: __metadata__.comment: expected a string")
        self.metadata = meta
        self._check_config(meta["config"])
        self._check_vocab(meta["vocab"])
        self.data_start = PREFIX_BYTES + n
        self.buffer_len = buffer_len = size - self.data_start
        self.entries: dict[str, Entry] = {}
        for name, obj in header.items():
            entry = _parse_entry(path, name, obj, alignment, buffer_len)
            for sub in ("table", "scale"):
                if sub in obj:
                    setattr(entry, sub, _parse_entry(path, name, obj[sub], alignment, buffer_len,
                                                     f"tensor {name!r}.{sub}"))
            self._check_parts(name, entry)
            self.entries[name] = entry
        spans = sorted((p.begin, p.end, name) for name, e in self.entries.items() for p in e.parts())
        for (b0, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise SqtError(f"{path}: tensor {n1!r}.data_offsets: [{b1}, ...) overlaps tensor {n0!r} [{b0}, {e0})")
        self._check_names()

    # -- validation -----------------------------------------------------------------------------------------

    def _check_config(self, config) -> None:
        path = self.path
        _check_keys(path, "__metadata__.config", config, {"text": dict})
        if "vision" not in config:
            raise SqtError(f"{path}: __metadata__.config.vision: missing (null for a text-only model)")
        text = config["text"]
        _check_keys(path, "__metadata__.config.text", text, TEXT_KEYS)
        for key in ("d_layers", "d_vocab", "d_model", "d_mlp", "d_attention_head", "d_attention_q",
                    "d_attention_kv", "d_sequence_max"):
            if text[key] < 1:
                raise SqtError(f"{path}: __metadata__.config.text.{key}: must be >= 1, got {text[key]}")
        if len(text["rope_angular_frequency"]) != text["d_attention_head"] // 2 or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in text["rope_angular_frequency"]):
            raise SqtError(f"{path}: __metadata__.config.text.rope_angular_frequency: expected "
                           f"{text['d_attention_head'] // 2} numbers (d_attention_head / 2)")
        if not all(_is_int(i) and 0 <= i < text["d_layers"] for i in text["cross_attention_layers"]):
            raise SqtError(f"{path}: __metadata__.config.text.cross_attention_layers: layer indices in "
                           f"[0, {text['d_layers']}) expected")
        if config["vision"] is not None:
            vision = config["vision"]
            _check_keys(path, "__metadata__.config.vision", vision, VISION_KEYS)
            for key in ("image_mean", "image_std"):
                if len(vision[key]) != 3:
                    raise SqtError(f"{path}: __metadata__.config.vision.{key}: expected 3 numbers (RGB)")
            if not all(_is_int(i) for i in vision["output_taps"]):
                raise SqtError(f"{path}: __metadata__.config.vision.output_taps: expected layer indices")

    def _check_vocab(self, vocab) -> None:
        path = self.path
        _check_keys(path, "__metadata__.vocab", vocab, VOCAB_KEYS)
        size = len(vocab["vocab"])
        if not size or not all(isinstance(t, str) for t in vocab["vocab"]):
            raise SqtError(f"{path}: __metadata__.vocab.vocab: expected a non-empty list of token strings")
        if not all(isinstance(m, str) for m in vocab["merges"]):
            raise SqtError(f"{path}: __metadata__.vocab.merges: expected a list of strings (each pair joined)")
        if len(set(vocab["merges"])) != len(vocab["merges"]):
            raise SqtError(f"{path}: __metadata__.vocab.merges: duplicates (merges are de-duplicated)")
        for key in ("begin_of_text_id", "start_header_id", "end_header_id", "eot_id", "image_id"):
            value = vocab[key]
            if value is not None and not 0 <= value < size:
                raise SqtError(f"{path}: __metadata__.vocab.{key}: {value} is outside the vocabulary [0, {size})")
        stops = vocab["stop_token_ids"]
        if not stops or not all(_is_int(i) and 0 <= i < size for i in stops) or stops != sorted(set(stops)):
            raise SqtError(f"{path}: __metadata__.vocab.stop_token_ids: expected a non-empty sorted list of "
                           f"distinct token ids, got {json.dumps(stops)[:60]}")

    def _check_parts(self, name: str, e: Entry) -> None:
        path = self.path
        if e.dtype == "BF16":
            for sub in ("table", "scale"):
                if getattr(e, sub) is not None:
                    raise SqtError(f"{path}: tensor {name!r}.{sub}: a BF16 tensor has no {sub}")
            return
        if e.dtype == "S3D8":
            if e.table is None:
                raise SqtError(f"{path}: tensor {name!r}.table: missing (an S3D8 tensor needs its INT8 [32, 3] table)")
            if e.table.dtype != "INT8" or e.table.shape != TABLE_SHAPE:
                raise SqtError(f"{path}: tensor {name!r}.table: expected INT8 {list(TABLE_SHAPE)}, got "
                               f"{e.table.dtype} {list(e.table.shape)}")
        elif e.table is not None:
            raise SqtError(f"{path}: tensor {name!r}.table: an INT8 tensor has no table")
        if len(e.shape) != 2:
            raise SqtError(f"{path}: tensor {name!r}.shape: an {e.dtype} tensor is 2-D [d_out, d_in], got {list(e.shape)}")
        if e.scale is None:
            raise SqtError(f"{path}: tensor {name!r}.scale: missing (an {e.dtype} tensor needs a BF16 [d_out, 1] scale)")
        if e.scale.dtype != "BF16" or e.scale.shape != (e.shape[0], 1):
            raise SqtError(f"{path}: tensor {name!r}.scale: expected BF16 [{e.shape[0]}, 1], got "
                           f"{e.scale.dtype} {list(e.scale.shape)}")

    def expected_tensors(self) -> dict[str, tuple[int, ...] | None]:
        """Every tensor the engine loads for this config: name -> shape (None: any shape)."""
        text = self.metadata["config"]["text"]
        D, H, M = text["d_model"], text["d_attention_head"], text["d_mlp"]
        q, kv = text["d_attention_q"] * text["d_attention_kv"], text["d_attention_kv"]
        want: dict[str, tuple[int, ...] | None] = {"text_model.embed_tokens.weight": None,
                                                    "text_model.norm.weight": (D,)}
        if not text["tied_embeddings"]:
            want["text_model.lm_head.weight"] = (text["d_vocab"], D)
        for i in range(text["d_layers"]):
            p = f"text_model.layers.{i}"
            want.update({f"{p}.attn.q_proj.weight": (q * H, D), f"{p}.attn.k_proj.weight": (kv * H, D),
                         f"{p}.attn.v_proj.weight": (kv * H, D), f"{p}.attn.o_proj.weight": (D, q * H),
                         f"{p}.attn.norm.weight": (D,), f"{p}.mlp.gate_proj.weight": (M, D),
                         f"{p}.mlp.up_proj.weight": (M, D), f"{p}.mlp.down_proj.weight": (D, M),
                         f"{p}.mlp.norm.weight": (D,)})
            if i in text["cross_attention_layers"]:
                want.update({f"{p}.attn.q_norm.weight": (H,), f"{p}.attn.k_norm.weight": (H,)})
        vision = self.metadata["config"]["vision"]
        if vision is not None:
            Dv, Mv = vision["d_model"], vision["d_mlp"]
            want.update({"vision_model.patch_embedding.weight": (Dv, 3, vision["d_patch"], vision["d_patch"]),
                         "vision_model.positional_embedding.weight": None,
                         "vision_model.class_embedding.weight": None,
                         "vision_model.tile_embedding_post.weight": None,
                         "vision_model.multi_modal_projector.weight": (len(vision["output_taps"]) + 1, D, Dv),
                         "vision_model.multi_modal_projector.bias": (D,)})
            for part in ("pre", "post"):
                want.update({f"vision_model.layernorm_{part}.weight": (Dv,),
                             f"vision_model.layernorm_{part}.bias": (Dv,)})
            for group, n in (("layers0", vision["d_layers0"]), ("layers1", vision["d_layers1"])):
                for i in range(n):
                    p = f"vision_model.{group}.{i}"
                    for proj in "qkvo":
                        want[f"{p}.attn.{proj}_proj.weight"] = (Dv, Dv)
                    want.update({f"{p}.mlp.up_proj.weight": (Mv, Dv), f"{p}.mlp.up_proj.bias": (Mv,),
                                 f"{p}.mlp.down_proj.weight": (Dv, Mv), f"{p}.mlp.down_proj.bias": (Dv,)})
                    for norm in ("attn.norm", "mlp.norm"):
                        want.update({f"{p}.{norm}.weight": (Dv,), f"{p}.{norm}.bias": (Dv,)})
        return want

    def _check_names(self) -> None:
        path, want = self.path, self.expected_tensors()
        extra = sorted(set(self.entries) - set(want))
        if extra:
            raise SqtError(f"{path}: tensor {extra[0]!r}: not a tensor the engine reads (an unfolded gate?)")
        for name, shape in want.items():
            if name not in self.entries:
                raise SqtError(f"{path}: tensor {name!r}: missing (the engine loads it for this config)")
            if shape is not None and self.entries[name].shape != shape:
                raise SqtError(f"{path}: tensor {name!r}.shape: {list(self.entries[name].shape)}, the config "
                               f"implies {list(shape)}")
        embed = self.entries["text_model.embed_tokens.weight"]
        text = self.metadata["config"]["text"]
        if len(embed.shape) != 2 or embed.shape[1] != text["d_model"] or embed.shape[0] < text["d_vocab"]:
            raise SqtError(f"{path}: tensor 'text_model.embed_tokens.weight'.shape: {list(embed.shape)}, expected "
                           f"[>= {text['d_vocab']}, {text['d_model']}]")
        for name in FORCE_BF16[:1] + ("vision_model.positional_embedding.weight",
                                       "vision_model.class_embedding.weight",
                                       "vision_model.tile_embedding_post.weight"):
            if name in self.entries and self.entries[name].dtype != "BF16":
                raise SqtError(f"{path}: tensor {name!r}.dtype: {self.entries[name].dtype}, the engine reads it as BF16")

    # -- data -----------------------------------------------------------------------------------------------

    def raw(self, part: Entry) -> torch.Tensor:
        """The bytes of one part as a tensor of its dtype (flat)."""
        with open(self.path, "rb") as f:
            f.seek(self.data_start + part.begin)
            data = bytearray(f.read(part.end - part.begin))
        t = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        return t.view({"BF16": torch.bfloat16, "INT8": torch.int8, "S3D8": torch.uint8}[part.dtype])

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor decoded: BF16 as stored (bf16), INT8 and S3D8 to float32 (values times channel scale)."""
        if name not in self.entries:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        e = self.entries[name]
        if e.dtype == "BF16":
            return self.raw(e).reshape(e.shape)
        scale = self.raw(e.scale).reshape(e.shape[0], 1)
        if e.dtype == "INT8":
            return self.raw(e).reshape(e.shape).float() * scale.float()
        from pipeline.formats import s3d8

        return s3d8.decode(self.raw(e), scale, self.raw(e.table).reshape(TABLE_SHAPE), e.shape)

    def check_data(self) -> None:
        """Read the whole buffer: gaps and padding zero, tables in [0, 127], scales finite, bf16 finite."""
        path = self.path
        ends = {}
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            buf = memoryview(m)[self.data_start:]
            try:
                spans = sorted((p.begin, p.end, name) for name, e in self.entries.items() for p in e.parts())
                pos = 0
                for begin, end, name in spans:
                    if any(buf[pos:begin]):
                        raise SqtError(f"{path}: buffer: bytes [{pos}, {begin}) before tensor {name!r} are not zero")
                    pos = max(pos, end)
                    ends[name] = end
                if any(buf[pos:]):
                    raise SqtError(f"{path}: buffer: bytes after the last tensor are not zero")
            finally:
                buf.release()
        for name, e in self.entries.items():
            if e.table is not None:
                table = self.raw(e.table)
                if bool(((table < 0) | (table > 127)).any()):
                    raise SqtError(f"{path}: tensor {name!r}.table: centroids must be in [0, 127]")
            for part, what in ((e.scale, "scale"), (e if e.dtype == "BF16" else None, "data")):
                if part is not None and not bool(torch.isfinite(self.raw(part).float()).all()):
                    raise SqtError(f"{path}: tensor {name!r}.{what}: contains NaN or Inf")


def read_sqt(path: str | os.PathLike, *, check_data: bool = True) -> SqtFile:
    """Open and validate a ``.sqt`` v3 file (``check_data``: also read every byte of the buffer)."""
    f = SqtFile(path)
    if check_data:
        f.check_data()
    return f


def summary(f: SqtFile) -> str:
    counts: dict[str, int] = {}
    for e in f.entries.values():
        counts[e.dtype] = counts.get(e.dtype, 0) + 1
    text, vision = f.metadata["config"]["text"], f.metadata["config"]["vision"]
    return (f"{f.path}: .sqt version {f.version}, alignment {f.alignment}, {len(f.entries)} tensors "
            f"({', '.join(f'{n} {d}' for d, n in sorted(counts.items()))}), text {text['d_layers']} layers x "
            f"{text['d_model']}, vision {'none' if vision is None else str(vision['d_layers0']) + '+' + str(vision['d_layers1']) + ' layers'}, "
            f"vocab {len(f.metadata['vocab']['vocab'])} tokens, {f.path.stat().st_size} bytes: OK")
