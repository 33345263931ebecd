"""Hugging Face model directories of packed models: write them, load them with ``from_pretrained``, save
them again with ``save_pretrained``.

A packed model directory (``models/packed/<format>/<method>/``) holds ``config.json`` (the teacher's config
with ``model_type`` ``s3d8-pipeline-<base model_type>``, :func:`guard_model_type`, a ``quantization_config``
and the install hint :data:`HINT_KEY`), the processor files, ``generation_config.json``, a model card
``README.md`` and the packed weights of SPEC section 7: ``model.safetensors`` (exactly what
:func:`pipeline.packed.write_packed` writes, so the Llama-Mobile reference loader and
:func:`pipeline.packed.load_packed_model` read it as before) or, above ``max_shard_size``, shards of the same
tensors and metadata listed in ``model.safetensors.index.json``.

Once ``pipeline`` is imported (see ``pipeline/__init__.py``), ``AutoModelForImageTextToText.from_pretrained(dir)``
(``AutoModelForCausalLM`` for a text-only Llama) builds the model on ``meta``, puts a placeholder holding the
packed tensors of every quantised module in place, lets transformers load the file, then swaps in modules
that keep the weights packed in memory, as bitsandbytes and torchao do (:class:`PackedQuantConfig`: S3D8 on
the native CPU kernels, other formats and devices decoded a block at a time in each forward). The model
computes in the ``dtype`` given to ``from_pretrained`` (default ``"auto"``: config.json's, bfloat16 for the
Llama teachers); with the same kernel, decode and dtype its logits equal ``load_packed_model``'s bit for bit,
and ``kernel="torch", dtype=torch.float32`` is the QAT forward bit for bit. ``model.save_pretrained(dir)``
writes the packed bytes it holds back unchanged (:func:`save_packed`).

Without ``pipeline``, transformers does not know the guard ``model_type`` and raises at once; an unknown
``quant_method`` alone would only make it warn and load random weights (tested). With ``pipeline`` imported,
any checkpoint holding packed tensors that no packed-format quantizer loads is refused (:func:`_refuse_unloaded`):
a missing or misspelled ``quantization_config`` never yields random weights.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.quantizers import auto as hf_auto
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from pipeline import formats
from pipeline.checkpoint import CheckpointReader
from pipeline.models import checkpoint_names
from pipeline.packed import PACKED_VERSION, packed_format, plan_packed, read_metadata, write_packed
from pipeline.packed_modules import DECODES, check_kernel, packed_layer
from pipeline.recipe import replace
from pipeline import safetensors_io
from pipeline.safetensors_io import TORCH_DTYPES, StreamingWriter

GUARD_PREFIX = "s3d8-pipeline-"
BASE_MODEL_TYPES = ("mllama", "llama")
"""Base ``model_type``s a packed directory may have (each gets a registered guard type)."""
BASE_MODEL_TYPE = "mllama"
MODEL_TYPE = GUARD_PREFIX + BASE_MODEL_TYPE
"""``model_type`` of a packed Mllama directory's ``config.json``: unknown to plain transformers (a loud error
that names the package), read as ``mllama`` once ``pipeline`` is imported."""
HINT_KEY = "s3d8_pipeline"
INSTALL = "pip install <path to an s3d8-pipeline checkout or its wheel>"
HINT = (f"Packed weights: loading needs the s3d8-pipeline package ({INSTALL}; it is not on PyPI) and "
        f"`import pipeline` before from_pretrained. See README.md.")
"""``config.json``'s :data:`HINT_KEY`: what a user who opens the file after transformers refused it reads."""
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MAX_SHARD_SIZE = 5 * 10**9
"""Bytes above which the packed weights are sharded (Llama 3.2 11B Vision in S3D8, about 3.6 GB, stays one
file, the reference's layout). Not a parameter in ``params.yaml``: it changes the layout, not a result."""
KERNELS = ("auto", "torch", "native")


logger = logging.getLogger("transformers.quantizers.s3d8")


def guard_model_type(base: str) -> str:
    """The ``model_type`` a packed directory of a ``base`` model carries (``s3d8-pipeline-mllama``)."""
    return GUARD_PREFIX + base


def quant_method(fmt: str) -> str:
    """``quant_method`` of a format: ``s3d8`` for S3D8, ``s3d8-pipeline-<name>`` for the other packed formats."""
    return "s3d8" if fmt == "s3d8" else f"s3d8-pipeline-{fmt}"


_method_of = quant_method


def _packable(name, what: str = "quantization_config.format"):
    packable = {f.name: f for f in formats.packable()}
    if name not in packable:
        raise ValueError(f"{what} is {name!r}, not one of {sorted(packable)}")
    return packable[name]


def read_header(path: str | os.PathLike) -> tuple[dict[str, tuple[str, list[int]]], dict[str, str]]:
    """``({tensor: (dtype, shape)}, metadata)`` of a safetensors file, from its header alone."""
    entries, meta, _ = safetensors_io.read_header(path)
    return {k: (v["dtype"], list(v["shape"])) for k, v in entries.items()}, meta


# --- the quantization config and quantizer registered with transformers ---------------------------------

class PackedQuantConfig(QuantizationConfigMixin):
    """``quantization_config`` of a packed directory.

    Saved in ``config.json`` (what HF quantizers carry): ``quant_method``, ``format``, ``layout``, ``version``
    (of the packed layout; older directories say ``format_version``), ``bits_per_weight`` (nominal, of the
    quantised weights) and ``modules_to_not_convert`` (checkpoint names of the linear and embedding modules
    stored unquantised). Loading options, never saved (``from_pretrained(..., quantization_config=
    PackedQuantConfig(...))`` overrides only these):

    - ``kernel``: ``"auto"`` (default: ``"native"`` where it runs, i.e. S3D8 with INT8 activations on the CPU,
      else ``"torch"``), ``"torch"`` (``F.linear`` on weights decoded from the packed bytes, any device) or
      ``"native"`` (S3D8 on the native CPU kernels, needs the model on the CPU).
    - ``decode``: ``"lazy"`` (default: modules keep the packed bytes and decode in each forward, a block of rows
      at a time, embeddings only the rows looked up) or ``"eager"`` (weights decoded once at load, in the
      model's dtype: more memory, faster ``kernel="torch"``; such a model cannot be saved packed again).
    - ``act_quant``: INT8 activations per token (the QAT forward), default true.
    """

    def __init__(self, format: str = "s3d8", quant_method: str | None = None, layout: str | None = None,
                 version: str | None = None, bits_per_weight: float | None = None,
                 modules_to_not_convert: list[str] | None = None, kernel: str = "auto", decode: str = "lazy",
                 act_quant: bool = True, format_version: str | None = None, **kwargs) -> None:
        if kwargs:
            raise ValueError(f"quantization_config: unknown field(s) {sorted(kwargs)}")
        fmt = _packable(format)
        expected = _method_of(fmt.name)
        if quant_method is not None and quant_method != expected:
            raise ValueError(f"quantization_config.quant_method is {quant_method!r} but its format {fmt.name!r} "
                             f"is loaded by quant_method {expected!r}")
        if layout is not None and layout != fmt.layout:
            raise ValueError(f"quantization_config.layout is {layout!r}, format {fmt.name!r} has {fmt.layout!r}")
        if version is not None and format_version is not None and str(version) != str(format_version):
            raise ValueError(f"quantization_config.version is {version!r} but format_version is {format_version!r}")
        version = PACKED_VERSION if version is None and format_version is None else str(version or format_version)
        if version != PACKED_VERSION:
            raise ValueError(f"quantization_config.version is {version!r}; this reader knows {PACKED_VERSION!r}")
        if bits_per_weight is not None and (isinstance(bits_per_weight, bool)
                                            or not isinstance(bits_per_weight, (int, float)) or bits_per_weight <= 0):
            raise ValueError(f"quantization_config.bits_per_weight is {bits_per_weight!r}, not a positive number")
        if modules_to_not_convert is not None and (not isinstance(modules_to_not_convert, list)
                                                   or not all(isinstance(m, str) for m in modules_to_not_convert)):
            raise ValueError(f"quantization_config.modules_to_not_convert is {modules_to_not_convert!r}, not a "
                             f"list of module names")
        if kernel not in KERNELS:
            raise ValueError(f"quantization_config.kernel is {kernel!r}, not one of {list(KERNELS)}")
        if decode not in DECODES:
            raise ValueError(f"quantization_config.decode is {decode!r}, not one of {list(DECODES)}")
        if not isinstance(act_quant, bool):
            raise ValueError(f"quantization_config.act_quant is {act_quant!r}, not true/false")
        self.quant_method = expected
        self.format = fmt.name
        self.layout = fmt.layout
        self.version = version
        self.bits_per_weight = bits_per_weight
        self.modules_to_not_convert = modules_to_not_convert
        self.kernel = kernel
        self.decode = decode
        self.act_quant = act_quant

    def get_loading_attributes(self) -> dict:
        return {"kernel": self.kernel, "decode": self.decode, "act_quant": self.act_quant}

    def to_saved_dict(self) -> dict:
        """What ``config.json`` stores: the file's description, not this session's loading options."""
        saved = {"quant_method": self.quant_method, "format": self.format, "layout": self.layout,
                 "version": self.version}
        if self.bits_per_weight is not None:
            saved["bits_per_weight"] = self.bits_per_weight
        if self.modules_to_not_convert is not None:
            saved["modules_to_not_convert"] = list(self.modules_to_not_convert)
        return saved

    def to_dict(self) -> dict:
        # transformers serialises the config (config.json, repr, hub metadata) through to_dict: no loading option
        # may leak into a saved directory
        return self.to_saved_dict()


class _PackedParts(nn.Module):
    """The packed tensors of one weight as buffers, so that the state-dict names are ``P.weight.<suffix>``."""


class _PackedSlot(nn.Module):
    """Stands in for a quantised module between model construction (on meta) and the end of loading. A module
    tied to another (``lm_head`` to ``embed_tokens``) gets no tensors (``specs`` None): it shares its owner's."""

    def __init__(self, module: nn.Module, specs: dict[str, tuple[torch.dtype, list[int]]] | None,
                 shape: tuple[int, int]):
        super().__init__()
        self.weight = _PackedParts()
        for suffix, (dtype, sh) in (specs or {}).items():
            self.weight.register_buffer(suffix, torch.empty(sh, dtype=dtype, device="meta"))
        self.linear = isinstance(module, nn.Linear)
        self.bias = module.bias if self.linear else None
        self.padding_idx = None if self.linear else module.padding_idx
        self.shape = shape

    def forward(self, *args, **kwargs):
        raise RuntimeError("packed weights were not decoded (the model was not loaded by from_pretrained)")


def _untie(model: nn.Module, target: str) -> None:
    """Drop ``target`` (``lm_head.weight``) from transformers' tied-weight maps: the packed modules share the
    packed tensors themselves, and transformers would otherwise tie (and mark) a parameter that is gone."""
    for prefix, module in model.named_modules():
        keys = getattr(module, "all_tied_weights_keys", None)
        if keys and (not prefix or target.startswith(f"{prefix}.")):
            keys.pop(target.removeprefix(f"{prefix}.") if prefix else target, None)


def resolve_kernel(kernel: str, fmt, act_quant: bool, device_map) -> str:
    """``"auto"`` made concrete: the native kernels where they run (S3D8, INT8 activations, CPU), else torch."""
    devices = set(device_map.values()) if isinstance(device_map, dict) else {device_map}
    cpu = {None, "cpu", torch.device("cpu")} | ({"auto"} if not torch.cuda.is_available() else set())
    on_cpu = devices <= cpu
    if kernel == "auto":
        return "native" if fmt.native_kernel and act_quant and on_cpu else "torch"
    check_kernel(kernel, fmt, act_quant)
    if kernel == "native" and not on_cpu:
        raise ValueError(f"kernel 'native' runs on the CPU: load with device_map='cpu' (got {device_map!r})")
    return kernel


class PackedHfQuantizer(HfQuantizer):
    """Loads a packed directory: placeholders on meta before loading, packed modules after."""

    requires_calibration = True          # packed files only: there is no on-the-fly quantisation

    def __init__(self, quantization_config: PackedQuantConfig, **kwargs) -> None:
        if not kwargs.get("pre_quantized", True):
            raise ValueError("PackedQuantConfig loads packed directories (config.json with its quantization_config); "
                             "it does not quantise a model: pack it first (s3d8 pack MODEL OUT_DIR)")
        super().__init__(quantization_config, **kwargs)
        self.dtype = torch.float32
        self.kernel = "torch"
        self.source: dict = {}            # what save_packed needs: the file's header, metadata, names

    def validate_environment(self, device_map=None, **kwargs) -> None:
        cfg = self.quantization_config
        self.kernel = resolve_kernel(cfg.kernel, _packable(cfg.format), cfg.act_quant, device_map)

    def update_dtype(self, dtype: torch.dtype) -> torch.dtype:
        self.dtype = dtype
        return dtype

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        cfg = self.quantization_config
        fmt = _packable(cfg.format)
        if not checkpoint_files:
            raise ValueError("packed models load from files: no checkpoint file was found")
        header: dict[str, tuple[str, list[int]]] = {}
        where: dict[str, str] = {}
        for file in checkpoint_files:
            index = Path(file).parent / INDEX_NAME
            if not Path(file).is_file() and index.is_file():
                raise FileNotFoundError(f"{index}: 'weight_map' names {Path(file).name}, which does not exist")
            tensors, _ = read_header(file)
            header.update(tensors)
            where.update(dict.fromkeys(tensors, file))
        first = checkpoint_files[0]
        config_json = Path(first).parent / "config.json"
        meta = read_metadata(first)
        if meta.get("format") != fmt.name:
            raise ValueError(f"{first}: metadata 'format' is {meta.get('format')!r}, but {config_json} "
                             f"quantization_config.format is {fmt.name!r}")
        packed_format(first, meta, fmt)
        plan = plan_packed(first, meta, model, fmt, header, where)
        with torch.device("cpu"):                  # the model is built under a meta-device context
            names = checkpoint_names(model)
        not_converted = set(cfg.modules_to_not_convert or ())
        tied = getattr(model, "all_tied_weights_keys", None) or {}
        for p in plan:
            module = model.get_submodule(p.module_name)
            if p.tied or f"{p.module_name}.weight" in tied:    # shares its owner's packed tensors, loaded once
                _untie(model, f"{p.module_name}.weight")
                replace(model, p.module_name, _PackedSlot(module, None, p.shape))
                continue
            if p.saved.removesuffix(".weight") in not_converted:
                raise ValueError(f"{where[p.parts[fmt.suffixes[0]]]}: {p.saved!r} is stored packed, but "
                                 f"{config_json} quantization_config.modules_to_not_convert lists it")
            specs = {s: (TORCH_DTYPES[header[key][0]], header[key][1]) for s, key in p.parts.items()}
            replace(model, p.module_name, _PackedSlot(module, specs, p.shape))
        expected = set(names.values()) - {p.saved for p in plan} | {k for p in plan for k in p.parts.values()}
        unknown = sorted(set(header) - expected)
        if unknown:
            raise ValueError(f"{where[unknown[0]]}: tensor {unknown[0]!r} does not belong to this model "
                             f"({len(unknown)} such tensors)")
        missing = sorted(expected - set(header))
        if missing:
            raise ValueError(f"{first}: {len(missing)} tensors the model ({config_json}) needs are missing, "
                             f"e.g. {missing[:3]}")
        self.source = {"header": header, "metadata": meta, "names": names,
                       "packed": {p.module_name: p.saved for p in plan}, "file": first}
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        cfg = self.quantization_config
        fmt = _packable(cfg.format)
        first = self.source.get("file", "the checkpoint")
        slots = [(n, m) for n, m in model.named_modules() if isinstance(m, _PackedSlot)]
        loaded = {}                   # by checkpoint name: a tied module's slot holds none of its own
        for name, slot in slots:
            tensors = {s: getattr(slot.weight, s, None) for s in fmt.suffixes}
            if all(t is not None and not t.is_meta for t in tensors.values()):
                loaded[self.source["packed"][name]] = tensors
        for name, slot in slots:
            saved = self.source["packed"][name]
            if saved not in loaded:
                raise RuntimeError(f"packed tensors of {name!r} were not loaded")
            bias = None if slot.bias is None else slot.bias.detach()
            replace(model, name, packed_layer(first, saved, fmt, loaded[saved], slot.shape, bias, slot.padding_idx,
                                              linear=slot.linear, kernel=self.kernel, decode=cfg.decode,
                                              act_quant=cfg.act_quant, dtype=self.dtype))
        # transformers' save_pretrained would write the model's state dict under a "format: pt" header and
        # the base model_type: save_packed writes the packed directory this model came from instead
        model.save_pretrained = functools.partial(save_packed, model)     # a partial survives pickle and deepcopy
        return model

    def is_serializable(self, **kwargs) -> bool:
        # reached only through transformers' own PreTrainedModel.save_pretrained, which would drop the layout
        logger.warning("a packed model is saved by model.save_pretrained(dir) as pipeline.hf.save_packed installs "
                       "it at load; call pipeline.hf.save_packed(model, dir) directly")
        return False

    @property
    def is_trainable(self) -> bool:
        return False


def _guard_config(base: str) -> type:
    """A config class registered as ``s3d8-pipeline-<base>`` that reads the directory as ``base``'s config."""
    base_class = CONFIG_MAPPING[base]

    def from_dict(cls, config_dict, **kwargs):
        return base_class.from_dict({**config_dict, "model_type": base}, **kwargs)

    return type(f"Packed{base_class.__name__}", (base_class,),
                {"model_type": guard_model_type(base), "from_dict": classmethod(from_dict),
                 "__doc__": f"Reads a packed {base} directory's config.json as a {base_class.__name__}."})


_PACKED_SUFFIXES = frozenset(s for f in formats.packable() for s in f.suffixes)


def _packed_tensor(files) -> tuple[str, str, str | None] | None:
    """``(file, what, format)`` of the first packed tensor in the safetensors ``files``, or None: a file
    whose metadata names a packed format, or a tensor ``P.weight.<suffix>`` with no ``P.weight`` beside it."""
    packable = {f.name for f in formats.packable()}
    for file in files or ():
        if not str(file).endswith(".safetensors") or not Path(file).is_file():
            continue
        header, meta = read_header(file)
        if meta.get("format") in packable:
            return str(file), f"metadata 'format' {meta['format']!r}", meta["format"]
        for name in header:
            base, _, suffix = name.rpartition(".")
            if suffix in _PACKED_SUFFIXES and base.endswith(".weight") and base not in header:
                return str(file), f"tensor {name!r}", None
    return None


def _refuse_unloaded(model, checkpoint_files, load_config) -> None:
    """Packed tensors that no packed-format quantizer loads would leave their modules randomly initialised
    (transformers only warns about an unknown quant_method and unexpected keys): refuse them instead."""
    quantizer = getattr(load_config, "hf_quantizer", None)
    if isinstance(quantizer, PackedHfQuantizer):
        return
    found = _packed_tensor(checkpoint_files)
    if found is None or (found[2] is None and quantizer is not None):     # another quantizer's own names
        return
    file, what, fmt = found
    config_json = Path(file).parent / "config.json"
    qc = getattr(model.config, "quantization_config", None)
    if qc is None:
        problem = "has no quantization_config"
    else:
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
        known = sorted(quant_method(f.name) for f in formats.packable())
        problem = f"has quantization_config.quant_method {method!r}, not one of the packed formats' {known}"
    fix = (f"{{\"quant_method\": {quant_method(fmt)!r}, \"format\": {fmt!r}}}" if fmt else
           "the quant_method and format pack-safetensors wrote").replace("'", '"')
    raise ValueError(f"{file} holds weights packed by s3d8-pipeline ({what}), but {config_json} {problem}, so "
                     f"transformers would load random weights in their place; set quantization_config to {fix}, "
                     f"or load the file with pipeline.packed.load_packed_model")


def _install_load_check() -> None:
    """Run :func:`_refuse_unloaded` in every ``from_pretrained``, where transformers reads the checkpoint files."""
    from transformers.modeling_utils import PreTrainedModel

    current = inspect.getattr_static(PreTrainedModel, "_load_pretrained_model")
    func = current.__func__ if isinstance(current, staticmethod) else current
    if getattr(func, "_s3d8_checked", False):
        return
    signature = inspect.signature(func)
    if not {"model", "checkpoint_files", "load_config"} <= set(signature.parameters):
        raise RuntimeError(f"pipeline.hf: PreTrainedModel._load_pretrained_model{signature} of this transformers "
                           f"has no (model, checkpoint_files, load_config): the check that refuses packed weights "
                           f"without their quantizer cannot be installed")

    @functools.wraps(func)
    def checked(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        _refuse_unloaded(bound["model"], bound["checkpoint_files"], bound["load_config"])
        return func(*args, **kwargs)

    checked._s3d8_checked = True
    PreTrainedModel._load_pretrained_model = staticmethod(checked) if isinstance(current, staticmethod) else checked


def register() -> None:
    """Register the config, quantizer, guard model types and packed-tensor check with transformers
    (idempotent)."""
    for f in formats.packable():
        method = quant_method(f.name)
        if method not in hf_auto.AUTO_QUANTIZATION_CONFIG_MAPPING:
            hf_auto.register_quantization_config(method)(PackedQuantConfig)
        if method not in hf_auto.AUTO_QUANTIZER_MAPPING:
            hf_auto.register_quantizer(method)(PackedHfQuantizer)
    if PackedQuantConfig not in hf_auto.LOADING_ATTRIBUTES_CONFIG_TYPES:
        # from_pretrained(quantization_config=PackedQuantConfig(kernel=...)) then overrides the loading options
        hf_auto.LOADING_ATTRIBUTES_CONFIG_TYPES = (*hf_auto.LOADING_ATTRIBUTES_CONFIG_TYPES, PackedQuantConfig)
    for base in BASE_MODEL_TYPES:
        if guard_model_type(base) not in CONFIG_MAPPING:
            AutoConfig.register(guard_model_type(base), _guard_config(base))
    _install_load_check()


# --- writing a packed directory -------------------------------------------------------------------------

def shard(directory: str | os.PathLike, max_shard_size: int = MAX_SHARD_SIZE) -> list[str]:
    """Split ``directory/model.safetensors`` into shards of at most ``max_shard_size`` bytes of tensors (a
    packed weight's parts stay together; a group larger than the limit gets a shard of its own), each with
    the same metadata, plus ``model.safetensors.index.json``. Below the limit nothing changes. Returns the
    weight files."""
    directory = Path(directory)
    single = directory / WEIGHTS_NAME
    if single.stat().st_size <= max_shard_size:
        return [WEIGHTS_NAME]
    header, meta = read_header(single)
    reader = CheckpointReader(single)
    groups: dict[str, list[str]] = {}
    for name in header:                              # file order: sorted names, a weight's parts adjacent
        base, _, suffix = name.rpartition(".")
        key = base if base.endswith(".weight") and base not in header else name
        groups.setdefault(key, []).append(name)

    def nbytes(name: str) -> int:
        dtype, shape = header[name]
        return int(torch.Size(shape).numel()) * torch.empty(0, dtype=TORCH_DTYPES[dtype]).element_size()

    shards: list[list[str]] = [[]]
    size = 0
    for names in groups.values():
        group = sum(nbytes(n) for n in names)
        if shards[-1] and size + group > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].extend(names)
        size += group
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, names in zip(files, shards):
        specs = [(n, TORCH_DTYPES[header[n][0]], tuple(header[n][1])) for n in names]
        with StreamingWriter(directory / file, specs, meta) as writer:
            for n in names:
                writer.write(n, reader.get(n))
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": sum(nbytes(n) for n in header), "format": meta.get("format"),
                          "format_version": meta.get("format_version")},
             "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    del reader
    single.unlink()
    return files


def weight_bytes(directory: str | os.PathLike) -> int:
    directory = Path(directory)
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def packed_config(config: dict, where, quantization: PackedQuantConfig) -> dict:
    """``config.json`` of a packed directory from its base model's: the guard ``model_type``, the
    ``quantization_config`` and the install hint."""
    base = config.get("model_type")
    if base not in BASE_MODEL_TYPES:
        raise ValueError(f"{where}: model_type {base!r}; packed directories are written for "
                         f"{list(BASE_MODEL_TYPES)} (pipeline.hf.BASE_MODEL_TYPES)")
    return {**config, "model_type": guard_model_type(base), "quantization_config": quantization.to_saved_dict(),
            HINT_KEY: HINT}


def write_model_dir(out: str | os.PathLike, source: CheckpointReader, fmt, states: dict[str, dict], *,
                    teacher_dir: str | os.PathLike, method: str, base_model: str, teacher_name: str,
                    dtype: torch.dtype = torch.bfloat16, metadata: dict | None = None,
                    max_shard_size: int = MAX_SHARD_SIZE, progress=None, encode=None) -> dict:
    """Write the Hugging Face directory of one packed model into ``out`` (an empty directory the caller
    makes atomic). Returns :func:`write_packed`'s summary with ``file_bytes`` the weight files' total."""
    from transformers import AutoProcessor, GenerationConfig

    out, teacher_dir = Path(out), Path(teacher_dir)
    config = json.loads((teacher_dir / "config.json").read_text())
    packed_config(config, teacher_dir / "config.json", PackedQuantConfig(format=fmt.name))   # fail before packing
    out.mkdir(parents=True, exist_ok=True)
    summary = write_packed(out / WEIGHTS_NAME, source, fmt, states, dtype=dtype, metadata=metadata, progress=progress,
                           encode=encode)
    files = shard(out, max_shard_size)
    summary["file_bytes"] = weight_bytes(out)
    summary["files"] = files
    unconverted = sorted(name.removesuffix(".weight") for name in source.keys()
                         if name.endswith(".weight") and len(source.shape(name)) == 2
                         and name.removesuffix(".weight") not in states)
    quantization = PackedQuantConfig(format=fmt.name, bits_per_weight=summary["bits_per_param_nominal"],
                                     modules_to_not_convert=unconverted)
    config = packed_config(config, teacher_dir / "config.json", quantization)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    AutoProcessor.from_pretrained(str(teacher_dir)).save_pretrained(str(out))
    try:
        generation = GenerationConfig.from_pretrained(str(teacher_dir))
    except OSError:
        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(teacher_dir)))
    generation.save_pretrained(str(out))
    (out / "README.md").write_text(model_card(fmt.name, method, summary, base_model=base_model,
                                              teacher_name=teacher_name, model_type=config["model_type"]))
    return summary


# --- saving a loaded packed model -----------------------------------------------------------------------

_SAVE_OPTIONS = ("is_main_process", "max_shard_size", "safe_serialization", "push_to_hub")


def _packed_parts(module: nn.Module, fmt) -> dict[str, torch.Tensor] | None:
    """The packed tensors a loaded module holds (lazy modules, the native kernels' buffers), or None for a
    module that holds only the decoded weight."""
    if hasattr(module, "packed_tensors"):
        return module.packed_tensors
    if all(isinstance(module._buffers.get(s), torch.Tensor) for s in fmt.suffixes):
        return {s: module._buffers[s] for s in fmt.suffixes}
    return None


def save_packed(model: nn.Module, save_directory: str | os.PathLike, **kwargs) -> None:
    """``model.save_pretrained(dir)`` of a model ``from_pretrained`` loaded from a packed directory: the
    same packed tensors under the same names, metadata and layout (byte for byte the file it was loaded from,
    if the model is unchanged), ``config.json`` with the guard ``model_type`` and the saved quantization
    config (never the loading options), ``generation_config.json`` and a model card. Nothing is re-quantised:
    a module decoded at load (``decode="eager"``) is an error. Files are written beside and moved into place;
    stale weight files of an earlier save are removed. ``max_shard_size`` (bytes or ``"5GB"``) and
    ``is_main_process`` as in transformers; the processor is saved by ``processor.save_pretrained``."""
    from transformers.utils.hub import convert_file_size_to_int

    unknown = sorted(set(kwargs) - set(_SAVE_OPTIONS))
    if unknown:
        raise ValueError(f"save_pretrained of a packed model: option(s) {unknown} are not supported (it writes the "
                         f"packed tensors the model holds; supported: {list(_SAVE_OPTIONS)})")
    if kwargs.get("push_to_hub"):
        raise ValueError("save_pretrained of a packed model: push_to_hub=True is not supported; save to a "
                         "directory, then upload it (huggingface_hub.upload_folder)")
    if kwargs.get("safe_serialization") is False:
        raise ValueError("save_pretrained of a packed model: packed weights are written as safetensors only")
    if not kwargs.get("is_main_process", True):
        return
    max_shard_size = convert_file_size_to_int(kwargs.get("max_shard_size", MAX_SHARD_SIZE))
    quantizer = getattr(model, "hf_quantizer", None)
    if not isinstance(quantizer, PackedHfQuantizer) or not quantizer.source:
        raise ValueError("save_packed: the model was not loaded from a packed directory by from_pretrained")
    cfg, source = quantizer.quantization_config, quantizer.source
    fmt = _packable(cfg.format)
    tensors: dict[str, torch.Tensor] = {}
    for module_name, saved in source["packed"].items():
        parts = _packed_parts(model.get_submodule(module_name), fmt)
        if parts is None:
            raise ValueError(f"save_pretrained: {module_name!r} holds its decoded weight, not the packed bytes "
                             f"(loaded with decode='eager'); re-quantising would change the model, so load it "
                             f"again with the default decode='lazy' and save that")
        tensors.update({f"{saved}.{s}": t for s, t in parts.items()})
    for name, t in model.state_dict().items():
        module_name, _, leaf = name.rpartition(".")
        if module_name in source["packed"] and leaf != "bias":
            continue
        if name not in source["names"]:
            raise ValueError(f"save_pretrained: tensor {name!r} of the model is not in the packed file it was loaded "
                             f"from ({source['file']})")
        tensors[source["names"][name]] = t
    header = source["header"]
    for problem, names in (("has no tensor", sorted(set(header) - set(tensors))),
                           ("has a tensor the file lacks", sorted(set(tensors) - set(header)))):
        if names:
            raise ValueError(f"save_pretrained: the model {problem} {names[0]!r} of {source['file']} "
                             f"({len(names)} such)")
    directory = Path(save_directory)
    if directory.is_file():
        raise ValueError(f"save_pretrained: {directory} is a file, not a directory")
    directory.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".s3d8-save.", dir=directory))
    try:
        specs = [(n, TORCH_DTYPES[header[n][0]], tuple(header[n][1])) for n in sorted(header)]
        with StreamingWriter(tmp / WEIGHTS_NAME, specs, source["metadata"]) as writer:
            for name, dtype, shape in specs:
                t = tensors[name].detach().to("cpu")
                if t.dtype != dtype and not (t.is_floating_point() and dtype.is_floating_point):
                    raise ValueError(f"save_pretrained: tensor {name!r} is {t.dtype}, the packed file stores "
                                     f"{dtype}")
                if t.numel() != torch.Size(shape).numel():
                    raise ValueError(f"save_pretrained: tensor {name!r} has shape {list(t.shape)}, the packed "
                                     f"file stores {list(shape)}")
                writer.write(name, t.to(dtype).reshape(shape))
        shard(tmp, max_shard_size)
        config = packed_config(model.config.to_diff_dict(), f"{directory}/config.json", cfg)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(str(tmp))
        meta = source["metadata"]
        (tmp / "README.md").write_text(model_card(
            fmt.name, meta.get("method", "unknown"), _card_summary(meta, tmp), model_type=config["model_type"],
            base_model=meta.get("source_model", "unknown"), teacher_name=meta.get("teacher", "model")))
        written = {f.name for f in tmp.iterdir()}
        for f in sorted(tmp.iterdir()):
            os.replace(f, directory / f.name)
        for stale in [*directory.glob("model*.safetensors"), directory / INDEX_NAME]:
            if stale.name not in written and stale.exists():          # an earlier save's other layout
                stale.unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- the model card -------------------------------------------------------------------------------------

def _is_hub_id(source: str) -> bool:
    return not Path(source).exists() and source.count("/") == 1 and not source.startswith((".", "/"))


def model_card(fmt: str, method: str, summary: dict, *, base_model: str, teacher_name: str,
               scores: dict | None = None, model_type: str = MODEL_TYPE) -> str:
    """README.md with Hugging Face metadata. ``scores``: ``reports/eval.json``'s content, or None (pack-safetensors
    runs before eval, so the card it writes says where the scores are; :func:`fill_card` adds them later)."""
    f = formats.get(fmt)
    vision = model_type == MODEL_TYPE
    task, auto = (("image-text-to-text", "AutoModelForImageTextToText") if vision
                  else ("text-generation", "AutoModelForCausalLM"))
    hub = _is_hub_id(base_model)
    license_ = "llama3.2" if "llama" in base_model.lower() else "other"
    lines = ["---"]
    if hub:
        lines += [f"base_model: {base_model}", "base_model_relation: quantized"]
    lines += [f"license: {license_}", "library_name: transformers", f"pipeline_tag: {task}", "tags:"]
    lines += [f"- {t}" for t in ("s3d8-pipeline", "quantized", f"{fmt}", method,
                                 model_type.removeprefix(GUARD_PREFIX), task)]
    lines += ["---", "", f"# {teacher_name}: {f.label} ({method})", ""]
    how = "cast directly from the teacher" if method == "direct-cast" else \
        "after quantisation-aware distillation from the teacher"
    lines += [f"`{base_model}` with every linear and embedding weight in **{f.label}** ({how}), written by "
              f"s3d8-pipeline.", "",
              "| | |", "| --- | --- |",
              f"| format | {f.label} (`quant_method: {quant_method(fmt)}`, layout `{f.layout}`) |",
              f"| bits per parameter | {summary['bits_per_param_nominal']:.3f} nominal, "
              f"{summary['bits_per_param_actual']:.3f} with padding and tables |",
              f"| quantised parameters | {summary['quantised_params']:,} |",
              f"| weight files | {summary['file_bytes'] / 1e6:,.1f} MB |", ""]
    lines += ["## Loading", "",
              "The weights load with the s3d8-pipeline package, which is not on PyPI: install it from its "
              "source checkout or from a wheel built there (`pip wheel --no-deps .`):", "",
              "```sh",
              INSTALL,
              "```", "",
              "```python",
              "import pipeline  # s3d8-pipeline: registers the packed format with transformers",
              f"from transformers import {auto}, AutoProcessor",
              "",
              f'model = {auto}.from_pretrained("path/to/this/directory")',
              'processor = AutoProcessor.from_pretrained("path/to/this/directory")',
              "```", "",
              "The weights stay packed in memory (S3D8 on the CPU runs on the package's native kernels); the model "
              "computes in the `dtype` passed to `from_pretrained` (default: the config's). "
              f"Without `import pipeline`, transformers stops with an error about the model type `{model_type}` "
              "(it cannot decode these weights). `model.safetensors` is the SPEC section 7 packed file"
              + (" (the Llama-Mobile reference loader reads it)." if fmt == "s3d8" else "."), ""]
    lines += ["## Evaluation", ""]
    key = f"{fmt}-{method}"
    models = (scores or {}).get("models", {})
    if key in models:
        rows = [(n, m) for n, m in models.items() if n in (key, "bf16-teacher")]
        tasks = list(models[key]["scores"])
        lines += ["| model | bits/param | KL to teacher | " + " | ".join(tasks) + " | average |",
                  "| --- | --- | --- | " + " | ".join("---" for _ in tasks) + " | --- |"]
        for n, m in rows:
            lines.append(f"| {n} | {m['bpp']:.2f} | {m['kl']:.4f} | "
                         + " | ".join(f"{m['scores'].get(t, float('nan')):.3f}" for t in tasks)
                         + f" | {m['avg']:.3f} |")
        lines.append("")
    else:
        lines += ["Scores of this run are in `reports/eval.json` and `reports/summary.md` of the same DVC revision "
                  "(the eval stage runs after packing); `python -m pipeline.hf card DIR --eval reports/eval.json` "
                  "writes them into this card.", ""]
    return "\n".join(lines)


def _card_summary(meta: dict[str, str], directory: Path) -> dict:
    return {"bits_per_param_nominal": float(meta["bits_per_param_nominal"]),
            "bits_per_param_actual": float(meta["bits_per_param_actual"]),
            "quantised_params": sum(torch.Size(s).numel() for s in json.loads(meta["shapes"]).values()),
            "file_bytes": weight_bytes(directory)}


def fill_card(directory: str | os.PathLike, eval_json: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Rewrite a packed directory's card with the scores of ``eval_json`` (run after eval, outside the DVC
    graph, e.g. on a copy before publishing: writing into ``models/packed`` changes a DVC output)."""
    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no packed weights")
    meta = read_metadata(files[0])
    scores = json.loads(Path(eval_json).read_text())
    config = directory / "config.json"
    model_type = json.loads(config.read_text()).get("model_type", MODEL_TYPE) if config.exists() else MODEL_TYPE
    text = model_card(meta["format"], meta.get("method", directory.name), _card_summary(meta, directory),
                      base_model=meta.get("source_model", "unknown"), teacher_name=meta.get("teacher", "model"),
                      scores=scores, model_type=model_type)
    target = Path(out) if out else directory / "README.md"
    target.write_text(text)
    return target


register()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pipeline.hf", description="packed model directories")
    sub = parser.add_subparsers(dest="command", required=True)
    card = sub.add_parser("card", help="write a packed directory's model card with this run's scores")
    card.add_argument("directory")
    card.add_argument("--eval", default="reports/eval.json")
    card.add_argument("--out", default=None, help="default: DIRECTORY/README.md")
    args = parser.parse_args()
    try:
        print(fill_card(args.directory, args.eval, args.out))
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"pipeline.hf: {e}")
