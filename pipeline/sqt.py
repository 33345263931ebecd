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

:func:`read_sqt` validates everything the engine requires (magic, version, alignment, header padding,
offsets, dtypes, byte lengths, table values, the tensors the config implies and their shapes, metadata and
vocab keys) and decodes tensors; any failure is one :class:`SqtError` naming the file and the field.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import mmap
import os
import re
import struct
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.layout import TABLE_SHAPE, packed_shape

MAGIC = b".sqt"
VERSION = 3
DEFAULT_ALIGNMENT = 32
PREFIX_BYTES = 16                  # magic, version, header length
DTYPES = ("BF16", "INT8", "S3D8")
_FORCE_BF16 = (                    # quantised in the packed file, decoded and stored as BF16 (SPEC section 9)
    "vision_model.multi_modal_projector.weight",
    "vision_model.gated_positional_embedding.tile_embedding.weight",
    "vision_model.pre_tile_positional_embedding.embedding.weight",
    "vision_model.post_tile_positional_embedding.embedding.weight",
)
TEXT_KEYS = {"d_layers": int, "d_vocab": int, "d_model": int, "d_mlp": int, "d_attention_head": int,
             "d_attention_q": int, "d_attention_kv": int, "d_sequence_max": int, "norm_epsilon": float,
             "rope_angular_frequency": list, "tied_embeddings": bool, "cross_attention_layers": list}
VISION_KEYS = {"image_mean": list, "image_std": list, "d_image": int, "d_patch": int, "d_layers0": int,
               "d_layers1": int, "d_model": int, "d_mlp": int, "d_attention_head": int,
               "d_attention_qkv": int, "norm_epsilon": float, "output_taps": list}
VOCAB_KEYS = {"chat_template": str, "begin_of_text_id": int, "start_header_id": int, "end_header_id": int,
              "eot_id": int, "stop_token_ids": list, "image_id": (int, type(None)), "pre_tokenizer": str,
              "merges": list, "vocab": list}
METADATA_KEYS = {"source": str, "created": str, "alignment": int, "config": dict, "vocab": dict}


class SqtError(ValueError):
    """A ``.sqt`` file (or an export's input) the engine would not load: the message names the file and field."""


def align(n: int, alignment: int) -> int:
    return n + (-n % alignment)


# --- the header's tensor entries --------------------------------------------------------------------------


@dataclass
class Entry:
    """One header entry ``{dtype, shape, data_offsets}`` (with nested ``table`` / ``scale`` entries)."""

    dtype: str
    shape: tuple[int, ...]
    begin: int = 0
    end: int = 0
    table: Entry | None = None
    scale: Entry | None = None

    @property
    def nbytes(self) -> int:
        return expected_bytes(self.dtype, self.shape)

    def to_json(self) -> dict:
        d = {"dtype": self.dtype, "shape": list(self.shape), "data_offsets": [self.begin, self.end]}
        if self.table is not None:
            d["table"] = self.table.to_json()
        if self.scale is not None:
            d["scale"] = self.scale.to_json()
        return d

    def parts(self) -> Iterator[Entry]:
        """Data, table, scale: the buffer order."""
        yield self
        if self.table is not None:
            yield self.table
        if self.scale is not None:
            yield self.scale


def expected_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    if dtype == "BF16":
        return 2 * math.prod(shape)
    if dtype == "INT8":
        return math.prod(shape)
    if dtype == "S3D8":
        return math.prod(packed_shape(*shape))
    raise ValueError(f"unknown dtype {dtype!r}")


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


def _json_file(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise SqtError(f"{path}: not valid JSON ({e})") from None
    return value if isinstance(value, dict) else None


def _model_config(file: Path, meta: dict[str, str], directory: Path | None):
    from transformers import AutoConfig

    if "config" in meta:
        try:
            cfg = json.loads(meta["config"])
        except ValueError as e:
            raise SqtError(f"{file}: metadata 'config' is not valid JSON ({e})") from None
        if not isinstance(cfg, dict) or not isinstance(cfg.get("model_type"), str):
            raise SqtError(f"{file}: metadata 'config' is not a model config (no 'model_type')")
        return AutoConfig.for_model(**cfg)
    if directory is not None and (directory / "config.json").is_file():
        return AutoConfig.from_pretrained(str(directory))
    raise SqtError(f"{file}: no model config (neither metadata 'config' nor a config.json beside it)")


def tokenizer_dir(file: Path, meta: dict[str, str], directory: Path | None, tokenizer: str | None) -> Path:
    """Where the tokenizer files are: ``tokenizer``, the model directory, or the packed file's source model."""
    if tokenizer is not None:
        path = Path(tokenizer)
        if not (path / "tokenizer.json").is_file():
            raise SqtError(f"{path}: --tokenizer: no tokenizer.json in this directory")
        return path
    if directory is not None and (directory / "tokenizer.json").is_file():
        return directory
    candidates = []
    for key in ("source_model", "teacher_dir", "teacher"):
        if meta.get(key):
            candidates.append(meta[key])
    for source in candidates:
        for base in (Path(source), file.parent / source):
            if (base / "tokenizer.json").is_file():
                return base
        try:
            from pipeline.teacher import local_dir

            found = local_dir(source)
        except Exception:  # noqa: BLE001 - not a directory or hub id: try the next candidate
            continue
        if (found / "tokenizer.json").is_file():
            return found
    raise SqtError(f"{file}: no tokenizer found (not beside the model, source_model "
                   f"{meta.get('source_model')!r} has none); pass --tokenizer DIR")


def _special_id(path: Path, added: dict[str, list[int]], token: str, required: bool = True) -> int | None:
    ids = added.get(token, [])
    if len(ids) > 1:
        raise SqtError(f"{path}: vocab: special token {token!r} has several ids {ids}")
    if not ids:
        if required:
            raise SqtError(f"{path}: vocab: special token {token!r} not found in the added tokens")
        return None
    return ids[0]


def vocab_block(directory: Path, config=None) -> dict:
    """The ``vocab`` metadata of SPEC section 9 from a Hugging Face tokenizer directory."""
    path = directory / "tokenizer.json"
    data = _json_file(path)
    if data is None:
        raise SqtError(f"{path}: tokenizer.json missing or not a JSON object")
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise SqtError(f"{path}: vocab: the engine reads byte-level BPE tokenizers, this one is {model.get('type')!r}")
    if not model.get("ignore_merges", False):
        warnings.warn(f"{path}: the tokenizer does not set ignore_merges; the reference engine always "
                      f"matches whole tokens first (ignore_merges = true)", stacklevel=2)
    pre = data.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    regex = [s["pattern"]["Regex"] for s in steps
             if s.get("type") == "Split" and isinstance(s.get("pattern"), dict) and "Regex" in s["pattern"]]
    if len(regex) != 1 or not any(s.get("type") == "ByteLevel" for s in steps):
        raise SqtError(f"{path}: vocab.pre_tokenizer: expected one Split regex and a ByteLevel step, got "
                       f"{[s.get('type') for s in steps]}")
    added: dict[str, list[int]] = {}
    tokens: dict[int, str] = {}
    for token, i in model.get("vocab", {}).items():
        tokens[int(i)] = token
    for t in data.get("added_tokens", []):
        added.setdefault(t["content"], []).append(int(t["id"]))
        tokens.setdefault(int(t["id"]), t["content"])
    if not tokens:
        raise SqtError(f"{path}: vocab: empty vocabulary")
    size = max(tokens) + 1
    missing = [i for i in range(size) if i not in tokens]
    if missing:
        raise SqtError(f"{path}: vocab: no token for ids {missing[:5]} (ids must run 0 .. {size - 1} without gaps)")
    merges, seen = [], set()
    for m in model.get("merges", []):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a + b not in seen:
            seen.add(a + b)
            merges.append(a + b)
    template = None
    if (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    else:
        tok_cfg = _json_file(directory / "tokenizer_config.json") or {}
        template = tok_cfg.get("chat_template")
        if isinstance(template, list):
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str):
        raise SqtError(f"{directory}: vocab.chat_template: no chat_template.jinja nor a chat_template in "
                       f"tokenizer_config.json")
    eot = _special_id(path, added, "<|eot_id|>")
    gen = _json_file(directory / "generation_config.json") or {}
    eos = gen.get("eos_token_id")
    if eos is None and config is not None:
        eos = getattr(getattr(config, "text_config", config), "eos_token_id", None)
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return {
        "chat_template": template,
        "begin_of_text_id": _special_id(path, added, "<|begin_of_text|>"),
        "start_header_id": _special_id(path, added, "<|start_header_id|>"),
        "end_header_id": _special_id(path, added, "<|end_header_id|>"),
        "eot_id": eot,
        "stop_token_ids": sorted({int(i) for i in eos} | {eot}),
        "image_id": _special_id(path, added, "<|image|>", required=False),
        "pre_tokenizer": regex[0],
        "merges": merges,
        "vocab": [tokens[i] for i in range(size)],
    }


def rope_angular_frequency(text) -> list[float]:
    """Per-pair rotary angular frequencies, with Llama 3 rope scaling applied (as the reference)."""
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    params = dict(getattr(text, "rope_parameters", None) or {})
    scaling = dict(getattr(text, "rope_scaling", None) or {}) or params
    theta = params.get("rope_theta", getattr(text, "rope_theta", None))
    if theta is None:
        raise SqtError("config: no rope_theta")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    freq = float(theta) ** -(torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    if kind == "llama3":
        z = ((scaling["original_max_position_embeddings"] * freq / (2 * torch.pi) - scaling["low_freq_factor"])
             / (scaling["high_freq_factor"] - scaling["low_freq_factor"]))
        freq = freq * torch.lerp(torch.tensor(1 / scaling["factor"]), torch.tensor(1.0), z.clip(0, 1))
    elif kind != "default":
        raise SqtError(f"config: rope_type {kind!r} is not supported by the engine (default or llama3)")
    return freq.tolist()


def _image_stats(directory: Path) -> tuple[list[float], list[float]]:
    for name in ("processor_config.json", "preprocessor_config.json"):
        cfg = _json_file(directory / name)
        if cfg is None:
            continue
        cfg = cfg.get("image_processor", cfg)
        if "image_mean" in cfg and "image_std" in cfg:
            return [float(v) for v in cfg["image_mean"]], [float(v) for v in cfg["image_std"]]
    raise SqtError(f"{directory}: config.vision.image_mean: no image processor config "
                   f"(processor_config.json / preprocessor_config.json with image_mean and image_std)")


def config_block(config, tok_dir: Path) -> dict:
    """``config`` metadata: ``text`` and ``vision`` (null for a text-only model)."""
    text = getattr(config, "text_config", config)
    vision = getattr(config, "vision_config", None)
    out = {"text": {
        "d_layers": text.num_hidden_layers,
        "d_vocab": text.vocab_size,
        "d_model": text.hidden_size,
        "d_mlp": text.intermediate_size,
        "d_attention_head": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        "d_attention_q": text.num_attention_heads // text.num_key_value_heads,
        "d_attention_kv": text.num_key_value_heads,
        "d_sequence_max": text.max_position_embeddings,
        "norm_epsilon": float(text.rms_norm_eps),
        "rope_angular_frequency": rope_angular_frequency(text),
        "tied_embeddings": bool(getattr(text, "tie_word_embeddings", False)),
        "cross_attention_layers": list(getattr(text, "cross_attention_layers", None) or []),
    }, "vision": None}
    if vision is not None:
        mean, std = _image_stats(tok_dir)
        out["vision"] = {
            "image_mean": mean, "image_std": std,
            "d_image": vision.image_size, "d_patch": vision.patch_size,
            "d_layers0": vision.num_hidden_layers, "d_layers1": vision.num_global_layers,
            "d_model": vision.hidden_size, "d_mlp": vision.intermediate_size,
            "d_attention_head": vision.hidden_size // vision.attention_heads,
            "d_attention_qkv": vision.attention_heads,
            "norm_epsilon": float(vision.norm_eps),
            "output_taps": list(vision.intermediate_layers_indices),
        }
    return out


class _Exporter:
    def __init__(self, file: Path, reader, fmt) -> None:
        self.file, self.reader, self.fmt = file, reader, fmt
        self.sources: dict[str, _Source] = {}       # engine name -> source tensor
        keys = set(reader.keys())
        for key in sorted(keys):
            base, _, suffix = key.rpartition(".")
            if suffix in fmt.suffixes and all(f"{base}.{s}" in keys for s in fmt.suffixes):
                if standard_name(base) in self.sources:
                    continue                        # the other parts of a weight already seen
                self.sources[standard_name(base)] = _Source(parts={s: f"{base}.{s}" for s in fmt.suffixes})
            else:
                self.sources[standard_name(key)] = _Source(key=key, shape=tuple(reader.shape(key)))
        shapes = json.loads(reader.metadata().get("shapes", "{}"))
        for name, src in self.sources.items():
            if src.parts is not None:
                base = src.parts["packed"].rpartition(".")[0]
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
        return self.fmt.unpack(tensors, src.shape).float()

    def gate(self, name: str) -> torch.Tensor:
        """``tanh(gate)`` in float32 (a gate is one value)."""
        t = self.dense(self.pop(name)).reshape(-1)
        if t.numel() != 1:
            raise SqtError(f"{self.file}: gate {name!r} has {t.numel()} values, expected 1")
        return torch.tanh(t[0])

    def out(self, src: _Source, factor: torch.Tensor | None = None, force_bf16: bool = False) -> _Out:
        """The tensor as stored: S3D8 bytes, table and (gate-scaled) scale; or BF16."""
        if src.parts is not None and not force_bf16:
            if len(src.shape) != 2:
                raise SqtError(f"{self.file}: quantised tensor {src.parts['packed']!r} has logical shape {src.shape}")
            d_out = src.shape[0]
            reader, parts = self.reader, src.parts

            def scale() -> torch.Tensor:
                s = reader.get(parts["scale"]).float().reshape(d_out, 1)
                return _bf16_bytes(s * factor if factor is not None else s)

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
        plan[name] = ex.out(src, folded.pop(name, None), force_bf16=name in _FORCE_BF16)
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
    from pipeline.checkpoint import CheckpointReader

    if alignment < 1 or alignment & (alignment - 1):
        raise SqtError(f"alignment {alignment}: must be a power of two")
    file, directory = resolve_model(model)
    reader = CheckpointReader(file)
    meta = reader.metadata()
    fmt = formats.get("s3d8")
    if meta.get("format") != fmt.name or meta.get("llama_mobile_format", fmt.layout) != fmt.layout:
        raise SqtError(f"{file}: metadata 'format' is {meta.get('format')!r}: the engine reads S3D8 packed models "
                       f"(SPEC section 7) only")
    config = _model_config(file, meta, directory)
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
                for part, produce in zip(o.entry.parts(), (o.data, o.table, o.scale)):
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


# --- reading and validating ---------------------------------------------------------------------------------


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
        for name in _FORCE_BF16[:1] + ("vision_model.positional_embedding.weight",
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
