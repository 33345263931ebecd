"""The packed model file (SPEC section 7): write it tensor by tensor, read it back into a model.

A plain safetensors file. For each quantised module at checkpoint path ``P``, the tensors its format
packs it into, ``P.weight.<suffix>`` (the format module says which: S3D8's ``packed`` / ``scale`` /
``table`` follow the Llama-Mobile reference layout, the 6-level formats' ``codes`` / ``scale`` /
``codepoints`` a layout of ours). Every other tensor is stored under its own name in the model's
dtype. Metadata: the format and its layout, logical shapes, bits per parameter (nominal and actual),
the model config, source and creation parameters.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pipeline import formats
from pipeline.checkpoint import CheckpointReader, StreamingWriter, module_to_checkpoint_names
from pipeline.formats import FormatBase
from pipeline.quant import fake_quant_activations
from pipeline.recipe import Quantised, quantised_modules, replace

PACKED_VERSION = "1"


def write_packed(out: str | Path, source: CheckpointReader, fmt: FormatBase, states: dict[str, dict],
                 *, dtype: torch.dtype = torch.bfloat16, metadata: dict | None = None,
                 progress: Callable[[str], None] | None = None) -> dict:
    """Pack the checkpoint ``source``: weights named ``P.weight`` with an entry ``P`` in ``states``
    are encoded in ``fmt``; every other tensor is copied in ``dtype`` (if floating point).
    Streams one tensor at a time. Returns a summary (sizes, bits per parameter)."""
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
            for suffix, (dt, sh) in fmt.packed_specs(shape, states[quantised[name]]).items():
                specs.append((f"{name}.{suffix}", dt, sh))
        else:
            probe = source.get(name)
            dt = dtype if probe.is_floating_point() else probe.dtype
            specs.append((name, dt, shape))
    specs.sort(key=lambda s: s[0])
    n_quantised = sum(torch.Size(s).numel() for s in shapes.values())
    nominal_bits = sum(fmt.bits_per_param(tuple(s)) * torch.Size(s).numel() for s in shapes.values())
    storage = sum(fmt.storage_bytes(tuple(s)) for s in shapes.values())
    meta = {
        "format": fmt.name,
        "format_version": PACKED_VERSION,
        "layout": fmt.layout,
        "shapes": json.dumps(shapes, sort_keys=True),
        "bits_per_param_nominal": f"{nominal_bits / max(n_quantised, 1):.6f}",
        "bits_per_param_actual": f"{8 * storage / max(n_quantised, 1):.6f}",
    }
    meta.update(fmt.file_metadata())
    meta.update({k: v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in (metadata or {}).items()})
    cache: dict[str, dict[str, torch.Tensor]] = {}
    with StreamingWriter(out, specs, meta) as writer:
        for name, dt, _ in specs:
            base, _, suffix = name.rpartition(".")
            if base in quantised and suffix in fmt.suffixes:
                if base not in cache:
                    cache.clear()
                    if progress:
                        progress(base)
                    cache[base] = fmt.pack(source.get(base), states[quantised[base]])
                writer.write(name, cache[base][suffix])
            else:
                t = source.get(name)
                writer.write(name, t.to(dt) if t.is_floating_point() else t)
    size = Path(out).stat().st_size
    return {"format": fmt.name, "file_bytes": size, "quantised_params": n_quantised,
            "bits_per_param_nominal": float(meta["bits_per_param_nominal"]),
            "bits_per_param_actual": float(meta["bits_per_param_actual"])}


class PackedLinear(Quantised):
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


class PackedEmbedding(Quantised):
    def __init__(self, weight: torch.Tensor, padding_idx: int | None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight, self.padding_idx)


KERNELS = ("torch", "native")


def check_kernel(kernel: str, fmt: FormatBase, act_quant: bool = True) -> None:
    """``kernel="native"`` needs a format the native kernels run, with INT8 activations."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r}: expected one of {', '.join(KERNELS)}")
    if kernel == "native" and not (fmt.native_kernel and act_quant):
        raise ValueError(f"kernel 'native' runs formats with a native kernel and INT8 activations only "
                         f"(format {fmt.name!r}, act_quant={act_quant})")


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
    packable = {f.name: f for f in formats.packable()}
    if meta.get("format") not in packable:
        raise ValueError(f"{path}: metadata 'format' is {meta.get('format')!r}, not one of {sorted(packable)}")
    fmt = packable[meta["format"]]
    check_kernel(kernel, fmt, act_quant)
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
        parts = {s: f"{saved}.{s}" for s in fmt.suffixes}
        if parts[fmt.suffixes[0]] not in reader:
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
            weight = fmt.unpack(tensors, shape).to(dtype)
        except ValueError as e:
            raise ValueError(f"{path}: tensor {saved!r}: {e}") from None
        used.update(parts.values())
        covered.add(f"{module_name}.weight")
        if isinstance(module, nn.Linear):
            bias = None
            if module.bias is not None:
                bias_name = names[f"{module_name}.bias"]
                bias = reader.get(bias_name).to(dtype)
                used.add(bias_name)
                covered.add(f"{module_name}.bias")
            if kernel == "native":  # the packed bytes through the native kernels (INT8 activations per token)
                layer = fmt.native_linear(tensors, shape, bias)
                covered.update(f"{module_name}.{name}" for name, _ in layer.named_buffers())
                replace(model, module_name, layer)
            else:
                replace(model, module_name, PackedLinear(weight, bias, act_quant))
        else:
            replace(model, module_name, PackedEmbedding(weight, module.padding_idx))
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


@dataclass
class PackParams:
    dtype: str = "bfloat16"      # of the tensors that are not quantised
