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
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pipeline import formats
from pipeline.packed.checkpoint import CheckpointReader
from pipeline.formats import FormatBase
from pipeline.models import checkpoint_names, meta_model
from pipeline.packed.modules import DECODES, check_finite, check_kernel, packed_layer
from pipeline.formats.precision import file_formats
from pipeline.recipe import quantised_modules, replace
from pipeline.packed.safetensors_io import DTYPES, StreamingWriter

PACKED_VERSION = "1"


def write_packed(out: str | Path, source: CheckpointReader, fmt: FormatBase, states: dict[str, dict],
                 *, dtype: torch.dtype = torch.bfloat16, metadata: dict | None = None,
                 progress: Callable[[str], None] | None = None,
                 encode: Callable[[str, torch.Tensor, dict], dict[str, torch.Tensor]] | None = None,
                 other: dict[str, FormatBase] | None = None) -> dict:
    """Pack the checkpoint ``source``: weights named ``P.weight`` with an entry ``P`` in ``states``
    are encoded in ``fmt``, or in ``other[P]`` (the precision plan's other formats: metadata ``formats``), by
    ``encode(P, weight, state)`` (default the format's ``pack``: a post-training method such as ``pipeline.cast.ptq``'s
    scale search may choose other scales and tables, the layout is the same); every other tensor is copied in
    ``dtype`` (if floating point). Streams one tensor at a time. Returns a summary (sizes, bits per parameter)."""
    other = other or {}
    unknown = sorted(set(other) - set(states))
    if unknown:
        raise ValueError(f"precision plan: {unknown[0]!r} is given a format but is not a quantised weight")
    fmt_of = {module: other.get(module, fmt) for module in states}
    encode = encode or (lambda name, weight, state: fmt_of[name].pack(weight, state))
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
            for suffix, (dt, sh) in fmt_of[quantised[name]].packed_specs(shape, states[quantised[name]]).items():
                specs.append((f"{name}.{suffix}", dt, sh))
        else:
            probe = source.get(name)
            dt = dtype if probe.is_floating_point() else probe.dtype
            specs.append((name, dt, shape))
    specs.sort(key=lambda s: s[0])
    n_quantised = sum(torch.Size(s).numel() for s in shapes.values())
    nominal_bits = sum(fmt_of[quantised[n]].bits_per_param(tuple(s)) * torch.Size(s).numel() for n, s in shapes.items())
    storage = sum(fmt_of[quantised[n]].storage_bytes(tuple(s)) for n, s in shapes.items())
    meta = {
        "format": fmt.name,
        "format_version": PACKED_VERSION,
        "layout": fmt.layout,
        "shapes": json.dumps(shapes, sort_keys=True),
        "bits_per_param_nominal": f"{nominal_bits / max(n_quantised, 1):.6f}",
        "bits_per_param_actual": f"{8 * storage / max(n_quantised, 1):.6f}",
    }
    if other:
        meta["formats"] = json.dumps({f"{m}.weight": f.name for m, f in sorted(other.items())}, sort_keys=True)
    meta.update(fmt.file_metadata())
    meta.update({k: v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in (metadata or {}).items()})
    cache: dict[str, dict[str, torch.Tensor]] = {}
    with StreamingWriter(out, specs, meta) as writer:
        for name, dt, _ in specs:
            base, _, suffix = name.rpartition(".")
            if base in quantised and suffix in fmt_of[quantised[base]].suffixes:
                if base not in cache:
                    cache.clear()
                    if progress:
                        progress(base)
                    cache[base] = encode(quantised[base], source.get(base), states[quantised[base]])
                writer.write(name, cache[base][suffix])
            else:
                t = source.get(name)
                writer.write(name, t.to(dt) if t.is_floating_point() else t)
    size = Path(out).stat().st_size
    return {"format": fmt.name, "file_bytes": size, "quantised_params": n_quantised,
            "bits_per_param_nominal": float(meta["bits_per_param_nominal"]),
            "bits_per_param_actual": float(meta["bits_per_param_actual"]),
            **bits_two_ways(specs, shapes, {n: fmt_of[quantised[n]] for n in shapes})}


def is_vocabulary(name: str) -> bool:
    """The token embedding and the output head: what the paper's bits per weight leave out."""
    return "embed_tokens" in name or name.startswith("lm_head")


def bits_two_ways(specs, shapes: dict[str, list[int]], fmt_of: dict) -> dict[str, float]:
    """Bits per weight as stored (tables, scales and padding included): ``bits_per_weight_whole`` over every
    weight matrix of the file (2-D or more; the quantised ones, the token embedding and a tied head once, and any
    kept in bf16 at their bytes), ``bits_per_weight_linears`` over the quantised matrices outside the vocabulary
    (:func:`is_vocabulary`), the paper's accounting."""
    whole_bits = whole_n = lin_bits = lin_n = 0
    for name, s in shapes.items():
        bits, n = 8 * fmt_of[name].storage_bytes(tuple(s)), torch.Size(s).numel()
        whole_bits, whole_n = whole_bits + bits, whole_n + n
        if not is_vocabulary(name):
            lin_bits, lin_n = lin_bits + bits, lin_n + n
    for name, dt, shape in specs:
        if name not in shapes and len(shape) >= 2 and dt.is_floating_point and name.rpartition(".")[0] not in shapes:
            whole_bits, whole_n = whole_bits + 8 * dt.itemsize * torch.Size(shape).numel(), whole_n + \
                torch.Size(shape).numel()
    return {"bits_per_weight_whole": round(whole_bits / max(whole_n, 1), 4),
            "bits_per_weight_linears": round(lin_bits / max(lin_n, 1), 4)}


def read_metadata(path: str | Path) -> dict[str, str]:
    return CheckpointReader(path).metadata()


# --- reading and validating the file ---------------------------------------------------------------------


def _json_field(path, meta: dict[str, str], key: str, kind: type, what: str):
    """Metadata ``key`` parsed as JSON of type ``kind``; anything else is one ValueError naming it."""
    raw = meta[key]
    try:
        value = json.loads(raw)
    except RecursionError:
        raise ValueError(f"{path}: metadata {key!r} is nested too deeply to be {what}") from None
    except ValueError as e:
        raise ValueError(f"{path}: metadata {key!r} is not valid JSON ({e})") from None
    if not isinstance(value, kind):
        raise ValueError(f"{path}: metadata {key!r} must be {what}, got a JSON {type(value).__name__}")
    return value


def _logical_shapes(path, meta: dict[str, str]) -> dict[str, tuple[int, int]]:
    if "shapes" not in meta:
        return {}
    shapes = _json_field(path, meta, "shapes", dict, "a JSON object {weight name: [d_out, d_in]}")
    out = {}
    for name, shape in shapes.items():
        if (not isinstance(shape, list) or len(shape) != 2
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape)):
            raise ValueError(f"{path}: metadata 'shapes' entry {name!r} must be [d_out, d_in] with positive "
                             f"whole numbers, got {shape!r}"[:400])
        out[name] = (shape[0], shape[1])
    return out


_LAYER_COUNT = re.compile(r"^num_\w*layers$")


def _check_layer_counts(path, cfg, n_tensors: int, where: str = "") -> None:
    """Every ``num_*layers`` count of the config is at most the number of tensors in the file (each layer
    holds at least one), so a corrupt count cannot make the model skeleton itself huge."""
    if isinstance(cfg, dict):
        for key, value in cfg.items():
            if (isinstance(value, int) and not isinstance(value, bool) and _LAYER_COUNT.match(str(key))
                    and value > n_tensors):
                raise ValueError(f"{path}: metadata 'config' sets {where}{key} = {value}, but the file holds "
                                 f"only {n_tensors} tensors")
            if isinstance(value, dict):
                _check_layer_counts(path, value, n_tensors, f"{where}{key}.")


def _model_on_meta(path, meta: dict[str, str], config, dtype: torch.dtype, n_tensors: int) -> nn.Module:
    """The model skeleton on the ``meta`` device (no memory), from ``config`` or the file's metadata."""
    from transformers import AutoConfig

    if config is None:
        if "config" not in meta:
            raise ValueError(f"{path}: no model config in the metadata; pass config=")
        cfg = _json_field(path, meta, "config", dict, "a JSON object (the model config)")
        _check_layer_counts(path, cfg, n_tensors)
        if not isinstance(cfg.get("model_type"), str):
            raise ValueError(f"{path}: metadata 'config' has no 'model_type' string")
        try:
            config = AutoConfig.for_model(**cfg)
        except Exception as e:  # transformers raises many kinds for a bad config
            raise ValueError(f"{path}: metadata 'config' is not a valid model config "
                             f"({type(e).__name__}: {str(e)[:300]})") from None
    try:
        return meta_model(config, dtype)     # Mllama or a text-only Llama, as the config says
    except Exception as e:
        raise ValueError(f"{path}: metadata 'config' does not build a model "
                         f"({type(e).__name__}: {str(e)[:300]})") from None


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _materialise_non_persistent(path, model: nn.Module) -> None:
    """Buffers the checkpoint never holds (rotary ``inv_freq``) are recomputed from the config, the way
    transformers' own loader does, after the model was built on ``meta``."""
    modules = {}
    for name, buf in model.named_buffers():
        if buf.is_meta:
            parent, _, leaf = name.rpartition(".")
            module = model.get_submodule(parent) if parent else model
            if leaf not in module._non_persistent_buffers_set:
                continue
            module._buffers[leaf] = torch.empty_like(buf, device="cpu")
            modules[parent] = module
    for module in modules.values():
        model._init_weights(module)


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    parent, _, leaf = name.rpartition(".")
    module = model.get_submodule(parent) if parent else model
    if leaf in module._parameters:
        old = module._parameters[leaf]
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=old.requires_grad)
    else:
        module._buffers[leaf] = tensor


@dataclass
class PackedWeight:
    """One quantised module of a model whose weight a packed file holds packed."""
    module_name: str
    saved: str                  # checkpoint name of the weight, P.weight
    parts: dict[str, str]       # suffix -> tensor name
    shape: tuple[int, int]      # the logical [d_out, d_in]
    bias: str | None            # checkpoint name of the bias (Linear with a bias)
    tied: bool                  # shares an earlier module's packed tensors (a tied lm_head): none of its own
    fmt: FormatBase             # the weight's format (the file's, or the precision plan's other one)


def packed_format(path, meta: dict[str, str], fmt: FormatBase | None = None) -> FormatBase:
    """The format a packed file's metadata names (``fmt`` when given: then it must name that one), with its
    ``format_version``, ``layout`` and the format's own metadata checked."""
    if fmt is None:
        fmt = formats.packed(meta.get("format"), f"{path}: metadata 'format'")
    if meta.get("format_version", PACKED_VERSION) != PACKED_VERSION:
        raise ValueError(f"{path}: metadata 'format_version' is {meta['format_version'][:40]!r}, this reader "
                         f"reads version {PACKED_VERSION!r}")
    if meta.get("layout", fmt.layout) != fmt.layout:
        raise ValueError(f"{path}: metadata 'layout' is {meta['layout'][:80]!r}, format {fmt.name!r} has "
                         f"layout {fmt.layout!r}")
    for key, value in fmt.file_metadata().items():
        if meta.get(key, value) != value:
            raise ValueError(f"{path}: metadata {key!r} is {meta[key][:80]!r}, expected {value!r}")
    return fmt


def plan_packed(path, meta: dict[str, str], model: nn.Module, names: dict[str, str], fmt: FormatBase,
                header: dict[str, tuple[str, list[int]]], where: dict[str, str] | None = None) -> list[PackedWeight]:
    """The quantised modules of ``model`` (built on ``meta``; ``names``: its :func:`checkpoint_names`, a tied
    lm_head under its embedding's name) that a packed file holds packed, from its headers alone (``header``:
    tensor -> (safetensors dtype, shape), of every file; ``where``: tensor -> its file, for messages): every part
    present with the dtype and shape ``fmt.packed_specs`` gives for the weight's logical shape (metadata ``shapes``,
    checked against the model's), none also stored unpacked. A module whose weight an earlier one holds (tied)
    is ``tied``. Nothing is read."""
    where = where or {}
    shapes = _logical_shapes(path, meta)
    others = file_formats(path, meta, fmt)
    plan: list[PackedWeight] = []
    seen: set[str] = set()
    for module_name, module in quantised_modules(model):
        saved = names[f"{module_name}.weight"]
        wfmt = others.get(saved, fmt)
        parts = wfmt.stored_names(saved)
        present = [k for k in parts.values() if k in header]
        if not present:
            continue                                           # stored unquantised
        file = where.get(present[0], path)
        for key in parts.values():
            if key not in header:
                raise ValueError(f"{file}: tensor {key!r} is missing (the other parts of {saved!r} are there)")
        if saved in header:
            raise ValueError(f"{file}: tensor {saved!r} is stored both packed and unpacked")
        expected = tuple(module.weight.shape)
        shape = shapes.get(saved, expected)
        if shape != expected:
            raise ValueError(f"{path}: metadata 'shapes' gives {saved!r} the logical shape {list(shape)}, the "
                             f"model expects {list(expected)}")
        for suffix, (want_dtype, want_shape) in wfmt.packed_specs(shape, {}).items():
            key = parts[suffix]
            got_dtype, got_shape = header[key]
            if got_dtype != DTYPES[want_dtype]:
                raise ValueError(f"{where.get(key, path)}: tensor {key!r} has dtype {got_dtype}, format "
                                 f"{wfmt.name!r} stores it as {DTYPES[want_dtype]}")
            if tuple(got_shape) != tuple(want_shape):
                raise ValueError(f"{where.get(key, path)}: tensor {key!r} has shape {list(got_shape)}, a weight "
                                 f"of logical shape {list(shape)} needs {list(want_shape)}")
        bias = names[f"{module_name}.bias"] if isinstance(module, nn.Linear) and module.bias is not None else None
        plan.append(PackedWeight(module_name, saved, parts, shape, bias, tied=saved in seen, fmt=wfmt))
        seen.add(saved)
    unknown = sorted((set(shapes) | set(others)) - seen)
    if unknown:
        raise ValueError(f"{path}: metadata 'shapes' names {unknown[0]!r}, which the file does not hold packed")
    return plan


def _plan_plain(path, reader: CheckpointReader, keys: list[str], to_module: dict[str, str],
                targets: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{checkpoint name: model state name}`` of the tensors stored unpacked, each checked against the model
    (it belongs to it, its shape; floating point where the model's is, all of them in one floating dtype)."""
    plain: dict[str, str] = {}
    float_dtypes: dict[str, list[str]] = {}
    for key in keys:
        if key not in to_module:
            raise ValueError(f"{path}: tensor {key!r} does not belong to this model")
        target = targets[to_module[key]]
        got_shape, got_dtype = tuple(reader.shape(key)), reader.dtype_name(key)
        if got_shape != tuple(target.shape):
            raise ValueError(f"{path}: tensor {key!r} has shape {list(got_shape)}, the model expects "
                             f"{list(target.shape)}")
        if target.is_floating_point():
            if got_dtype not in {DTYPES[d] for d in _FLOAT_DTYPES}:
                raise ValueError(f"{path}: tensor {key!r} has dtype {got_dtype}, the model expects a floating-point "
                                 f"tensor")
            float_dtypes.setdefault(got_dtype, []).append(key)
        elif got_dtype != DTYPES.get(target.dtype):
            raise ValueError(f"{path}: tensor {key!r} has dtype {got_dtype}, the model expects "
                             f"{DTYPES.get(target.dtype, target.dtype)}")
        plain[key] = to_module[key]
    if len(float_dtypes) > 1:     # the writer stores every unquantised tensor in one dtype
        odd = min(float_dtypes.items(), key=lambda kv: (len(kv[1]), kv[0]))
        common = max(float_dtypes.items(), key=lambda kv: (len(kv[1]), kv[0]))[0]
        raise ValueError(f"{path}: tensor {odd[1][0]!r} has dtype {odd[0]}, the other unquantised tensors {common}")
    return plain


def load_packed_model(path: str | Path, *, config=None, act_quant: bool = True,
                      dtype: torch.dtype = torch.float32, kernel: str = "torch",
                      decode: str = "eager", private: bool = False) -> nn.Module:
    """Build the model from its config (stored in the file's metadata unless given), swap in a packed
    module wherever the file holds an encoded weight, and load every other tensor.

    The file is validated before any tensor is read: a regular, complete safetensors file; metadata
    ``format`` / ``layout`` / ``format_version`` / ``config`` / ``shapes`` well formed; every packed part
    present with the dtype and shape ``fmt.packed_specs`` gives for the weight's logical shape; every
    other tensor belongs to the model with its shape (one floating dtype for all of them); nothing
    missing. Then, tensor by tensor: scales finite and > 0, every packed weight decodes (the format's
    checks), plain tensors finite. Any failure is one ``ValueError`` (``FileNotFoundError`` for a missing
    path) naming the file and the tensor or metadata field. The model is built on the ``meta`` device
    and only what the file provides is materialised, so a corrupt config costs no memory.

    ``kernel="torch"``: ``F.linear`` on fake-quantised activations (the QAT forward, bit for bit), with
    ``decode="eager"`` (weights decoded once at load, in ``dtype``) or ``decode="lazy"`` (modules keep the
    packed tensors and decode in each forward, embeddings only the rows looked up, a Linear above 64M
    weights a block of rows at a time: same numbers, memory about the file's size). ``kernel="native"`` (S3D8, INT8): the native kernels on the packed bytes for
    linear layers; embeddings follow ``decode``. ``private``: the file's tensors read into private memory, not
    mapped (:class:`~pipeline.packed.checkpoint.CheckpointReader`), for a model kept for a process's lifetime; with
    ``decode="lazy"`` an embedding that is not also the output head stays mapped from the file instead, each lookup
    bringing in the rows it reads (the 11B's 128,264-row table is 0.5 GB in INT8, of which a prompt reads a few
    hundred rows)."""
    if decode not in DECODES:
        raise ValueError(f"decode {decode!r}: expected one of {', '.join(DECODES)}")
    reader = CheckpointReader(path, private=private)
    meta = reader.metadata()
    fmt = packed_format(path, meta)
    keys = set(reader.keys())
    model = _model_on_meta(path, meta, config, dtype, len(keys))
    names = checkpoint_names(model)
    to_module = {v: k for k, v in names.items()}
    targets = model.state_dict(keep_vars=True)           # meta tensors: names, shapes, dtypes

    # --- plan from the headers alone: nothing is read or allocated yet -----------------------------------
    plan = plan_packed(path, meta, model, names, fmt, {k: (reader.dtype_name(k), reader.shape(k)) for k in keys})
    for f in {p.fmt.name: p.fmt for p in plan}.values() or [fmt]:
        check_kernel(kernel, f, act_quant)
    used = {k for p in plan for k in p.parts.values()}              # checkpoint tensors packed modules consume
    covered = {f"{p.module_name}.weight" for p in plan}             # model state names those modules provide
    plain = _plan_plain(path, reader, sorted(keys - used), to_module, targets)
    missing = [k for k in targets if k not in covered and k not in plain.values()]
    if missing:
        raise ValueError(f"{path}: tensors missing for {len(missing)} parameters, e.g. "
                         f"{[names.get(k, k) for k in missing[:3]]}")

    # --- materialise, tensor by tensor ----------------------------------------------------------------------
    shared = {p.saved for p in plan if p.tied}
    read: dict[str, dict[str, torch.Tensor]] = {}     # the packed tensors a tied module will share
    for p in plan:
        module = model.get_submodule(p.module_name)
        rows = private and decode == "lazy" and not isinstance(module, nn.Linear) and p.saved not in shared
        tensors = read.get(p.saved) or {s: reader.get(k, mapped=rows) for s, k in p.parts.items()}
        if p.saved in shared:
            read[p.saved] = tensors
        bias = None
        if p.bias is not None:
            bias = reader.get(p.bias)
            check_finite(path, p.bias, bias.float())
            bias = bias.to(dtype)
        replace(model, p.module_name, packed_layer(path, p.saved, p.fmt, tensors, p.shape, bias,
                                                   getattr(module, "padding_idx", None),
                                                   linear=isinstance(module, nn.Linear), kernel=kernel,
                                                   decode=decode, act_quant=act_quant, dtype=dtype))
        if rows:                  # its check read every page: none is needed until a lookup
            reader.drop_mapped()
    del read
    biases = {p.bias for p in plan}
    for key, state_name in plain.items():
        if key in biases:         # read with its packed weight
            continue
        t = reader.get(key)
        target = targets[state_name]
        if t.is_floating_point():
            check_finite(path, key, t)
            t = t.to(target.dtype)
        _assign(model, state_name, t)
    del reader
    _materialise_non_persistent(path, model)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"{path}: tensors missing for {len(left)} parameters, e.g. {[names.get(k, k) for k in left[:3]]}")
    model.eval()
    return model

