"""The reference engine's ``.sqt`` file (SPEC section 9, version 3): export a packed S3D8 model, read one back.

    python -m pipeline.sqt export MODEL out.sqt [--tokenizer DIR] [--alignment 32] [--comment TEXT]
    python -m pipeline.sqt check FILE

``MODEL`` is a packed S3D8 file (SPEC section 7, ``models/packed/s3d8/qat.safetensors``) or a directory
holding one as ``model.safetensors`` (with ``config.json`` and the tokenizer files). The tokenizer (and the
image processor's mean and std, the chat template, the generation config's stop tokens) come from
``--tokenizer``, else from that directory, else from the packed file's ``source_model`` (the teacher).

Layout, little-endian: magic ``.sqt`` | u32 version 3 | u64 N | N bytes of compact JSON padded with spaces
so that ``(16 + N) % alignment == 0`` | the buffer. Every tensor starts aligned (gaps zero-filled);
``data_offsets`` are ``[begin, end)`` from the buffer start; per tensor the buffer holds data, table, scale.
Dtypes: ``BF16``; ``INT8`` (+ a BF16 ``[d_out, 1]`` scale); ``S3D8`` (the packed bytes of SPEC section 1,
header shape the logical ``[d_out, d_in]``, + an INT8 ``[32, 3]`` table and a BF16 ``[d_out, 1]`` scale).

Export, as the reference's exporter: names renamed (``language_model.model.`` -> ``text_model.``,
self/cross_attn -> attn, fc1/fc2 -> up/down_proj, input_layernorm -> attn.norm, post_attention_layernorm ->
mlp.norm, transformer -> layers0, global_transformer -> layers1, the projector under ``vision_model.``);
``tanh(gate)`` folded into cross-attention o_proj/down_proj and the global vision layers' o_proj/down_proj
(into the bf16 channel scale of an S3D8 weight, the packed bytes unchanged; into the down_proj bias);
positional and tile embeddings merged with their gates; projector and positional embeddings decoded and
stored as BF16, the projector reshaped to ``(n_taps + 1, d_out, d_in)``. Every other quantised weight keeps
its packed bytes, table and scale verbatim; every other tensor is stored as BF16. Gate products and merges
are computed in float32 and rounded to bf16 once (the reference computes them in bf16).

:func:`pipeline.sqt.read.read_sqt` validates everything the engine requires (magic, version, alignment,
header padding, offsets, dtypes, byte lengths, table values, the tensors the config implies and their shapes,
metadata and vocab keys) and decodes tensors; any failure is one :class:`SqtError` naming the file and the field.

This module holds the export and the command line; the file's constants and header entries are in
:mod:`pipeline.sqt.container`, the config and vocab metadata builders in :mod:`pipeline.sqt.blocks`, the reader
in :mod:`pipeline.sqt.read`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.packed import layout
from pipeline.formats.int8 import LAYOUT as INT8_LAYOUT
from pipeline.packed.layout import TABLE_SHAPE
from pipeline.formats.precision import file_formats
from pipeline.sqt.blocks import model_config_of, config_block, tokenizer_dir, vocab_block
from pipeline.sqt.container import DEFAULT_ALIGNMENT, MAGIC, PREFIX_BYTES, VERSION, FORCE_BF16, Entry, SqtError, align
from pipeline.sqt.read import read_sqt, summary

ENGINE_DTYPES = {layout.NAME: "S3D8", INT8_LAYOUT: "INT8"}
"""The engine's dtype of each packed layout it reads (a precision plan's INT8 weights included)."""


# --- export: names, gates, merges -------------------------------------------------------------------------

_RENAMES = (
    (r"^model\.language_model\.", "text_model."),
    (r"^model\.vision_model\.", "vision_model."),
    (r"^model\.multi_modal_projector\.", "vision_model.multi_modal_projector."),
    (r"^multi_modal_projector\.", "vision_model.multi_modal_projector."),
    (r"^language_model\.model\.", "text_model."),
    (r"^language_model\.lm_head\.", "text_model.lm_head."),
    (r"^language_model\.", "text_model."),
    (r"^lm_head\.weight$", "text_model.lm_head.weight"),
    (r"\.(cross_attn|self_attn)\.", ".attn."),
    (r"\.fc1\.", ".up_proj."),
    (r"\.fc2\.", ".down_proj."),
    (r"\.input_layernorm\.", ".attn.norm."),
    (r"\.post_attention_layernorm\.", ".mlp.norm."),
    (r"\.transformer\.layers\.", ".layers0."),
    (r"\.global_transformer\.layers\.", ".layers1."),
)


def standard_name(name: str) -> str:
    """The engine's name of a Hugging Face (checkpoint or module) tensor name."""
    for pattern, replacement in _RENAMES:
        name = re.sub(pattern, replacement, name)
    return name


@dataclass
class _Source:
    """A tensor of the packed file: plain (``key``) or S3D8 (``parts``: packed / scale / table keys)."""

    key: str | None = None
    parts: dict[str, str] | None = None
    shape: tuple[int, ...] = ()
    fmt: object = None          # the format of a packed tensor (the file's, or the precision plan's other one)


@dataclass
class _Out:
    """One tensor to write: ``entry`` (dtype, shape) and the producers of its bytes (data, table, scale)."""

    entry: Entry
    data: Callable[[], torch.Tensor]
    table: Callable[[], torch.Tensor] | None = None
    scale: Callable[[], torch.Tensor] | None = None
    gates: list[str] = field(default_factory=list)       # gate tensors folded into it (tanh, multiplied)


def _bf16_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.bfloat16).contiguous().reshape(-1).view(torch.uint8)


def resolve_model(model: str | os.PathLike) -> tuple[Path, Path | None]:
    """``(packed file, model directory or None)`` for a packed file or a directory holding ``model.safetensors``."""
    path = Path(model)
    if path.is_dir():
        file = path / "model.safetensors"
        if not file.is_file():
            raise SqtError(f"{path}: no model.safetensors in this directory (expected a packed S3D8 model)")
        return file, path
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such packed model file or directory")
    return path, None


class _Exporter:
    def __init__(self, file: Path, reader, fmt) -> None:
        self.file, self.reader, self.fmt = file, reader, fmt
        self.sources: dict[str, _Source] = {}       # engine name -> source tensor
        keys = set(reader.keys())
        others = file_formats(file, reader.metadata(), fmt)
        for key in sorted(keys):
            base, _, suffix = key.rpartition(".")
            f = others.get(base, fmt)
            if suffix in f.suffixes and all(k in keys for k in f.stored_names(base).values()):
                if standard_name(base) in self.sources:
                    continue                        # the other parts of a weight already seen
                if f.layout not in ENGINE_DTYPES:
                    raise SqtError(f"{file}: {base!r} is stored in format {f.name!r}, which the engine cannot read")
                self.sources[standard_name(base)] = _Source(parts=f.stored_names(base), fmt=f)
            else:
                self.sources[standard_name(key)] = _Source(key=key, shape=tuple(reader.shape(key)))
        shapes = json.loads(reader.metadata().get("shapes", "{}"))
        for name, src in self.sources.items():
            if src.parts is not None:
                base = next(iter(src.parts.values())).rpartition(".")[0]
                if base not in shapes:
                    raise SqtError(f"{file}: metadata 'shapes' lacks the logical shape of {base!r}")
                src.shape = tuple(shapes[base])

    def pop(self, name: str) -> _Source:
        if name not in self.sources:
            raise SqtError(f"{self.file}: tensor for {name!r} not found in the packed model")
        return self.sources.pop(name)

    def dense(self, src: _Source) -> torch.Tensor:
        """The tensor in float32 (a quantised one decoded with the format's own ``unpack``)."""
        if src.parts is None:
            return self.reader.get(src.key).float()
        tensors = {s: self.reader.get(k) for s, k in src.parts.items()}
        return src.fmt.unpack(tensors, src.shape).float()

    def gate(self, name: str) -> torch.Tensor:
        """``tanh(gate)`` in float32 (a gate is one value)."""
        t = self.dense(self.pop(name)).reshape(-1)
        if t.numel() != 1:
            raise SqtError(f"{self.file}: gate {name!r} has {t.numel()} values, expected 1")
        return torch.tanh(t[0])

    def out(self, src: _Source, factor: torch.Tensor | None = None, force_bf16: bool = False) -> _Out:
        """The tensor as stored: S3D8 bytes, table and (gate-scaled) scale; INT8 values and (gate-scaled) scale;
        or BF16."""
        if src.parts is not None and not force_bf16:
            if len(src.shape) != 2:
                raise SqtError(f"{self.file}: quantised tensor {next(iter(src.parts.values()))!r} has logical "
                               f"shape {src.shape}")
            d_out = src.shape[0]
            reader, parts = self.reader, src.parts

            def scale() -> torch.Tensor:
                s = reader.get(parts["scale"]).float().reshape(d_out, 1)
                return _bf16_bytes(s * factor if factor is not None else s)

            if ENGINE_DTYPES[src.fmt.layout] == "INT8":
                return _Out(Entry("INT8", src.shape, scale=Entry("BF16", (d_out, 1))),
                            data=lambda: reader.get(parts["int8"]).reshape(-1).view(torch.uint8), scale=scale)
            return _Out(Entry("S3D8", src.shape, table=Entry("INT8", TABLE_SHAPE), scale=Entry("BF16", (d_out, 1))),
                        data=lambda: reader.get(parts["packed"]).reshape(-1).view(torch.uint8),
                        table=lambda: reader.get(parts["table"]).to(torch.int8).reshape(-1).view(torch.uint8),
                        scale=scale)
        return _Out(Entry("BF16", src.shape),
                    data=lambda: _bf16_bytes(self.dense(src) * factor if factor is not None else self.dense(src)))

    def constant(self, tensor: torch.Tensor) -> _Out:
        return _Out(Entry("BF16", tuple(tensor.shape)), data=lambda: _bf16_bytes(tensor))


def _plan(ex: _Exporter, config) -> dict[str, _Out]:
    """Every output tensor of the ``.sqt`` file, by engine name, in buffer order."""
    text = getattr(config, "text_config", config)
    vision = getattr(config, "vision_config", None)
    plan: dict[str, _Out] = {}
    folded: dict[str, torch.Tensor] = {}
    for i in getattr(text, "cross_attention_layers", None) or []:
        prefix = f"text_model.layers.{i}"
        folded[f"{prefix}.attn.o_proj.weight"] = ex.gate(f"{prefix}.cross_attn_attn_gate")
        folded[f"{prefix}.mlp.down_proj.weight"] = ex.gate(f"{prefix}.cross_attn_mlp_gate")
    if vision is not None:
        for i in range(vision.num_global_layers):
            prefix = f"vision_model.layers1.{i}"
            folded[f"{prefix}.attn.o_proj.weight"] = ex.gate(f"{prefix}.gate_attn")
            g = ex.gate(f"{prefix}.gate_ffn")
            folded[f"{prefix}.mlp.down_proj.weight"] = g
            folded[f"{prefix}.mlp.down_proj.bias"] = g
            if f"{prefix}.attn.o_proj.bias" in ex.sources:
                folded[f"{prefix}.attn.o_proj.bias"] = folded[f"{prefix}.attn.o_proj.weight"]
        n_tiles = vision.max_num_tiles
        n_patches = (vision.image_size // vision.patch_size) ** 2
        d = vision.hidden_size
        # Positional and class embeddings merged with their gates; row 0 of an aspect-ratio embedding is
        # the unused id 0 (the engine counts aspect ratios from 0).
        prefix = "vision_model.gated_positional_embedding"
        embedding0 = ex.dense(ex.pop(f"{prefix}.embedding"))
        gate = ex.gate(f"{prefix}.gate")
        tile = ex.dense(ex.pop(f"{prefix}.tile_embedding.weight"))[1:].unflatten(1, (n_tiles, n_patches + 1, d))
        embedding0 = embedding0 * (1 - gate) + tile * gate
        prefix = "vision_model.pre_tile_positional_embedding"
        pre = ex.dense(ex.pop(f"{prefix}.embedding.weight"))[1:].unflatten(1, (n_tiles, d))
        gate = ex.gate(f"{prefix}.gate")
        merged = {
            "vision_model.positional_embedding.weight": pre.unsqueeze(2) * gate + embedding0[:, :, 1:, :],
            "vision_model.class_embedding.weight": (ex.dense(ex.pop("vision_model.class_embedding"))
                                                    + embedding0[:, :, 0, :]),
        }
        prefix = "vision_model.post_tile_positional_embedding"
        post = ex.dense(ex.pop(f"{prefix}.embedding.weight"))[1:].unflatten(1, (n_tiles, d))
        merged["vision_model.tile_embedding_post.weight"] = post * ex.gate(f"{prefix}.gate")
        # The projector's input: the last hidden state, then the taps interleaved -> (n_taps + 1, d_out, d).
        proj = ex.dense(ex.pop("vision_model.multi_modal_projector.weight"))
        merged["vision_model.multi_modal_projector.weight"] = torch.cat(
            [proj[:, d:].unflatten(1, (d, -1)).movedim(2, 0), proj[None, :, :d]], dim=0)
        for name, tensor in merged.items():
            plan[name] = ex.constant(tensor)
    for name in list(ex.sources):
        src = ex.sources.pop(name)
        plan[name] = ex.out(src, folded.pop(name, None), force_bf16=name in FORCE_BF16)
    if folded:
        raise SqtError(f"{ex.file}: gated tensor {next(iter(folded))!r} not found in the packed model")
    return dict(sorted(plan.items()))


def export(model: str | os.PathLike, out: str | os.PathLike, *, tokenizer: str | None = None,
           alignment: int = DEFAULT_ALIGNMENT, comment: str | None = None, created: str | None = None) -> dict:
    """Write the ``.sqt`` v3 file of a packed S3D8 model (file or directory). Streams tensor by tensor into
    a temporary file renamed over ``out``. ``created`` (ISO-8601) defaults to now, or to
    ``$SOURCE_DATE_EPOCH`` when set (the reproducible-builds convention: same input, same bytes).
    Returns a summary (tensors, bytes)."""
    if created is None:
        epoch = os.environ.get("SOURCE_DATE_EPOCH")
        when = (datetime.datetime.fromtimestamp(int(epoch), datetime.timezone.utc) if epoch
                else datetime.datetime.now(datetime.timezone.utc))
        created = when.isoformat(timespec="seconds")
    from pipeline import formats
    from pipeline.packed.checkpoint import CheckpointReader

    if alignment < 1 or alignment & (alignment - 1):
        raise SqtError(f"alignment {alignment}: must be a power of two")
    file, directory = resolve_model(model)
    reader = CheckpointReader(file)
    meta = reader.metadata()
    fmt = formats.get(formats.SUBJECT)
    if meta.get("format") != fmt.name or meta.get("llama_mobile_format", fmt.layout) != fmt.layout:
        raise SqtError(f"{file}: metadata 'format' is {meta.get('format')!r}: the engine reads S3D8 packed models "
                       f"(SPEC section 7) only")
    config = model_config_of(file, meta, directory)
    tok_dir = tokenizer_dir(file, meta, directory, tokenizer)
    metadata = {
        "source": meta.get("source_model") or str(directory or file),
        "created": created,
        "alignment": alignment,
        "comment": (comment if comment is not None else
                    f"s3d8-pipeline export of {file.name} (method {meta.get('method', 'unknown')})"),
        "config": config_block(config, tok_dir),
        "vocab": vocab_block(tok_dir, config),
    }
    plan = _plan(_Exporter(file, reader, fmt), config)
    text = metadata["config"]["text"]
    if not text["tied_embeddings"] and "text_model.lm_head.weight" not in plan:
        raise SqtError(f"{file}: config.text.tied_embeddings is false but the model has no lm_head weight")
    offset = 0
    for o in plan.values():
        for part in o.entry.parts():
            part.begin, part.end = offset, offset + part.nbytes
            offset = align(part.end, alignment)
    header = {"__metadata__": metadata, **{name: o.entry.to_json() for name, o in plan.items()}}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(PREFIX_BYTES + len(raw)) % alignment)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", VERSION) + struct.pack("<Q", len(raw)) + raw)
            start = f.tell()
            for name, o in plan.items():
                for part, produce in zip(o.entry.parts(), [p for p in (o.data, o.table, o.scale) if p is not None]):
                    data = produce().numpy().tobytes()
                    if len(data) != part.nbytes or f.tell() != start + part.begin:
                        raise SqtError(f"{file}: tensor {name!r}: {len(data)} bytes produced, {part.nbytes} expected")
                    f.write(data)
                    f.write(b"\0" * (align(len(data), alignment) - len(data)))
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return {"path": str(out), "tensors": len(plan), "file_bytes": out.stat().st_size,
            "s3d8_tensors": sum(o.entry.dtype == "S3D8" for o in plan.values()), "tokenizer": str(tok_dir)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.sqt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write the .sqt v3 file of a packed S3D8 model")
    ex.add_argument("model", help="packed S3D8 .safetensors file, or a directory holding model.safetensors")
    ex.add_argument("out", help="output .sqt file")
    ex.add_argument("--tokenizer", help="tokenizer directory (default: beside the model, or its source model)")
    ex.add_argument("--alignment", type=int, default=DEFAULT_ALIGNMENT)
    ex.add_argument("--comment")
    ck = sub.add_parser("check", help="validate a .sqt file as the engine would load it")
    ck.add_argument("file")
    args = parser.parse_args(argv)
    try:
        if args.command == "export":
            result = export(args.model, args.out, tokenizer=args.tokenizer, alignment=args.alignment,
                            comment=args.comment)
            print(f"{result['path']}: {result['tensors']} tensors ({result['s3d8_tensors']} S3D8), "
                  f"{result['file_bytes']} bytes; tokenizer from {result['tokenizer']}")
            print(summary(read_sqt(result["path"])))
        else:
            print(summary(read_sqt(args.file)))
    except (SqtError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
