"""The packed model file (SPEC section 7): write it tensor by tensor, read it back into a model.

A plain safetensors file. For each quantised module at checkpoint path ``P``:

- S3D8 (interoperable with the Llama-Mobile reference, ``llama_mobile_format =
  llama-mobile-s3d8-packed-v1``): ``P.weight.packed`` uint8 1-D (the row-major
  ``[ceil(d_out/3), pad16(d_in)]`` bytes), ``P.weight.scale`` bf16 ``[d_out, 1]``,
  ``P.weight.table`` int8 ``[32, 3]``.
- ``int`` / ``student_t`` / ``lloyd_max`` (a layout of ours, ``s3d8-pipeline-scalar6-v1``):
  ``P.weight.codes`` uint8 1-D (3 codes per byte, ``c0 + 6 c1 + 36 c2``, row-major over the logical
  weight), ``P.weight.scale`` bf16 ``[d_out, n_blocks]``, ``P.weight.codepoints`` float32 ``[6]``.

Every other tensor is stored under its own name in the model's dtype. Metadata: the format, logical
shapes, bits per parameter (nominal and actual), the model config, source and creation parameters.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pipeline import formats
from pipeline.checkpoint import CheckpointReader, StreamingWriter, module_to_checkpoint_names
from pipeline.formats import s3d8, scalar
from pipeline.formats.base import ceil_div
from pipeline.qat.api import quantised_modules
from pipeline.quant import fake_quant_activations

LLAMA_MOBILE_FORMAT = "llama-mobile-s3d8-packed-v1"
SCALAR_FORMAT = "s3d8-pipeline-scalar6-v1"
PACKED_VERSION = "1"

Encoder = Callable[[torch.Tensor, dict], dict[str, torch.Tensor]]


def _s3d8_encode(weight: torch.Tensor, state: dict) -> dict[str, torch.Tensor]:
    native = s3d8.native_or_none()
    if native is not None:
        packed, scale = native.s3d8_encode(weight.float().contiguous(), state["table"])
    else:  # the reference encoder is bit-identical (tested), only slower
        warnings.warn("native S3D8 library not built (run ./setup.sh); packing with the Python encoder")
        packed, scale = s3d8.encode(weight.float(), state["table"])
    return {"packed": packed.reshape(-1), "scale": scale, "table": state["table"]}


def _s3d8_specs(shape, state) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    rows, cols = s3d8.packed_shape(shape)
    return {"packed": (torch.uint8, (rows * cols,)), "scale": (torch.bfloat16, (shape[0], 1)),
            "table": (torch.int8, (32, 3))}


def _s3d8_decode(t: dict[str, torch.Tensor], shape) -> torch.Tensor:
    return s3d8.decode(t["packed"], t["scale"], t["table"], shape)


def _scalar_codec(name: str):
    fmt = formats.get(name)

    def encode(weight, state):
        codes, scale = scalar.encode(weight.float(), state["codepoints"], fmt.block, fmt.qmax)
        return {"codes": codes, "scale": scale, "codepoints": state["codepoints"].float()}

    def specs(shape, state):
        n_blocks = ceil_div(shape[1], fmt.block or shape[1])
        return {"codes": (torch.uint8, (ceil_div(shape[0] * shape[1], 3),)),
                "scale": (torch.bfloat16, (shape[0], n_blocks)), "codepoints": (torch.float32, (6,))}

    def decode(t, shape):
        return scalar.decode(t["codes"], t["scale"], t["codepoints"], fmt.block, shape)

    return encode, specs, decode


@dataclass(frozen=True)
class Codec:
    encode: Encoder
    specs: Callable
    decode: Callable
    suffixes: tuple[str, ...]


CODECS: dict[str, Codec] = {"s3d8": Codec(_s3d8_encode, _s3d8_specs, _s3d8_decode, ("packed", "scale", "table"))}
for _name in ("int", "student_t", "lloyd_max"):
    _e, _s, _d = _scalar_codec(_name)
    CODECS[_name] = Codec(_e, _s, _d, ("codes", "scale", "codepoints"))


def codec(fmt: str) -> Codec:
    if fmt not in CODECS:
        raise ValueError(f"format {fmt!r} has no packed layout; packable formats: {', '.join(CODECS)}")
    return CODECS[fmt]


def write_packed(out: str | Path, source: CheckpointReader, fmt: str, states: dict[str, dict],
                 *, dtype: torch.dtype = torch.bfloat16, metadata: dict | None = None,
                 progress: Callable[[str], None] | None = None) -> dict:
    """Pack the checkpoint ``source``: weights named ``P.weight`` with an entry ``P`` in ``states``
    are encoded in ``fmt``; every other tensor is copied in ``dtype`` (if floating point).
    Streams one tensor at a time. Returns a summary (sizes, bits per parameter)."""
    c = codec(fmt)
    fmt_obj = formats.get(fmt)
    quantised = {f"{module}.weight": module for module in states}
    missing = sorted(name for name in quantised if name not in source)
    if missing:
        raise ValueError(f"{source.path}: the fitted state names weights the checkpoint lacks, e.g. {missing[:3]}")
    specs, shapes = [], {}
    for name in sorted(source.keys()):
        shape = source.shape(name)
        if name in quantised:
            if len(shape) != 2:
                raise ValueError(f"{source.path}: tensor {name!r} to quantise has shape {list(shape)}, not 2-D")
            shapes[name] = list(shape)
            for suffix, (dt, sh) in c.specs(shape, states[quantised[name]]).items():
                specs.append((f"{name}.{suffix}", dt, sh))
        else:
            probe = source.get(name)
            dt = dtype if probe.is_floating_point() else probe.dtype
            specs.append((name, dt, shape))
    specs.sort(key=lambda s: s[0])
    n_quantised = sum(torch.Size(s).numel() for s in shapes.values())
    nominal_bits = sum(fmt_obj.bits_per_param(tuple(s)) * torch.Size(s).numel() for s in shapes.values())
    storage = sum(fmt_obj.storage_bytes(tuple(s)) for s in shapes.values())
    meta = {
        "format": fmt,
        "format_version": PACKED_VERSION,
        "layout": LLAMA_MOBILE_FORMAT if fmt == "s3d8" else SCALAR_FORMAT,
        "shapes": json.dumps(shapes, sort_keys=True),
        "bits_per_param_nominal": f"{nominal_bits / max(n_quantised, 1):.6f}",
        "bits_per_param_actual": f"{8 * storage / max(n_quantised, 1):.6f}",
    }
    if fmt == "s3d8":
        meta["llama_mobile_format"] = LLAMA_MOBILE_FORMAT
    meta.update({k: v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in (metadata or {}).items()})
    cache: dict[str, dict[str, torch.Tensor]] = {}
    with StreamingWriter(out, specs, meta) as writer:
        for name, dt, _ in specs:
            base, _, suffix = name.rpartition(".")
            if base in quantised and suffix in c.suffixes:
                if base not in cache:
                    cache.clear()
                    if progress:
                        progress(base)
                    cache[base] = c.encode(source.get(base), states[quantised[base]])
                writer.write(name, cache[base][suffix])
            else:
                t = source.get(name)
                writer.write(name, t.to(dt) if t.is_floating_point() else t)
    size = Path(out).stat().st_size
    return {"format": fmt, "file_bytes": size, "quantised_params": n_quantised,
            "bits_per_param_nominal": float(meta["bits_per_param_nominal"]),
            "bits_per_param_actual": float(meta["bits_per_param_actual"])}


class PackedLinear(nn.Module):
    """A linear layer with its weight decoded once from the packed file; INT8 activations per token.

    The forward equals the QAT forward (``QuantLinear``) bit for bit: same decoded weight, same
    activation quantiser, same ``F.linear``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act_quant: bool) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.act_quant = act_quant
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_quant:
            x = fake_quant_activations(x)
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


class PackedEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, padding_idx: int | None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight, self.padding_idx)


def read_metadata(path: str | Path) -> dict[str, str]:
    return CheckpointReader(path).metadata()


def load_packed_model(path: str | Path, *, config=None, act_quant: bool = True,
                      dtype: torch.dtype = torch.float32, kernel: str = "torch") -> nn.Module:
    """Build the model from its config (stored in the file's metadata unless given), swap in a packed
    module wherever the file holds an encoded weight, and load every other tensor. A tensor the model
    needs but the file lacks, or one the file has but the model does not, is an error naming it.

    ``kernel="torch"``: weights decoded once, ``F.linear`` on fake-quantised activations (the QAT
    forward, bit for bit). ``kernel="native"`` (S3D8 only): the native kernels on the packed bytes."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    reader = CheckpointReader(path)
    meta = reader.metadata()
    fmt = meta.get("format")
    if fmt not in CODECS:
        raise ValueError(f"{path}: metadata 'format' is {fmt!r}, not one of {sorted(CODECS)}")
    c = CODECS[fmt]
    if kernel not in ("torch", "native"):
        raise ValueError(f"kernel {kernel!r}: expected 'torch' or 'native'")
    if kernel == "native" and (fmt != "s3d8" or not act_quant):
        raise ValueError(f"kernel 'native' runs S3D8 with INT8 activations only (format {fmt!r}, "
                         f"act_quant={act_quant})")
    if config is None:
        if "config" not in meta:
            raise ValueError(f"{path}: no model config in the metadata; pass config=")
        cfg = json.loads(meta["config"])
        config = AutoConfig.for_model(**cfg)
    model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    names = module_to_checkpoint_names(model)
    shapes = json.loads(meta.get("shapes", "{}"))
    used: set[str] = set()        # checkpoint tensors consumed by packed modules
    covered: set[str] = set()     # model state names those modules provide
    for module_name, module in list(quantised_modules(model)):
        saved = names[f"{module_name}.weight"]
        parts = {s: f"{saved}.{s}" for s in c.suffixes}
        if parts[c.suffixes[0]] not in reader:
            continue
        for s, key in parts.items():
            if key not in reader:
                raise ValueError(f"{path}: tensor {key!r} is missing (the other parts of {saved!r} are there)")
        shape = tuple(shapes.get(saved, module.weight.shape))
        if shape != tuple(module.weight.shape):
            raise ValueError(f"{path}: {saved!r} has logical shape {list(shape)}, the model expects "
                             f"{list(module.weight.shape)}")
        tensors = {s: reader.get(k) for s, k in parts.items()}
        try:
            weight = c.decode(tensors, shape).to(dtype)
        except ValueError as e:
            raise ValueError(f"{path}: tensor {saved!r}: {e}") from None
        used.update(parts.values())
        covered.add(f"{module_name}.weight")
        parent, _, child = module_name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        if isinstance(module, nn.Linear):
            bias = None
            if module.bias is not None:
                bias_name = names[f"{module_name}.bias"]
                bias = reader.get(bias_name).to(dtype)
                used.add(bias_name)
                covered.add(f"{module_name}.bias")
            if kernel == "native":  # the packed bytes through the native kernels (INT8 activations per token)
                from pipeline import native

                setattr(owner, child, native.S3D8Linear(tensors["packed"], tensors["scale"], tensors["table"],
                                                        shape, bias))
                covered.update(f"{module_name}.{b}" for b in ("packed", "scale", "table"))
            else:
                setattr(owner, child, PackedLinear(weight, bias, act_quant))
        else:
            setattr(owner, child, PackedEmbedding(weight, module.padding_idx))
    state = {}
    checkpoint_to_module = {v: k for k, v in names.items()}
    for key in reader.keys():
        if key in used:
            continue
        if key not in checkpoint_to_module:
            raise ValueError(f"{path}: tensor {key!r} does not belong to this model")
        state[checkpoint_to_module[key]] = reader.get(key)
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if k not in covered]
    if missing:
        raise ValueError(f"{path}: tensors missing for {len(missing)} parameters, e.g. "
                         f"{[names.get(k, k) for k in missing[:3]]}")
    model.eval()
    return model
