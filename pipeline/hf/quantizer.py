"""Hugging Face model directories of packed models loaded with ``from_pretrained``: the quantizer registered
with transformers (its config in :mod:`pipeline.hf.config`; :mod:`pipeline.hf.write` writes the directories and
saves a loaded model again).

A packed model directory (``models/packed/<format>/<method>/``) holds ``config.json`` (the teacher's config
with ``model_type`` ``s3d8-pipeline-<base model_type>``, :func:`guard_model_type`, a ``quantization_config``
and the install hint :data:`HINT_KEY`), the processor files, ``generation_config.json``, a model card
``README.md`` and the packed weights of SPEC section 7: ``model.safetensors`` (exactly what
:func:`pipeline.packed.file.write_packed` writes, so the Llama-Mobile reference loader and
:func:`pipeline.packed.file.load_packed_model` read it as before) or, above ``max_shard_size``, shards of the same
tensors and metadata listed in ``model.safetensors.index.json``.

Once ``pipeline`` is imported (see ``pipeline/__init__.py``), ``AutoModelForImageTextToText.from_pretrained(dir)``
(``AutoModelForCausalLM`` for a text-only Llama) builds the model on ``meta``, puts a placeholder holding the
packed tensors of every quantised module in place, lets transformers load the file, then swaps in modules
that keep the weights packed in memory, as bitsandbytes and torchao do (:class:`PackedQuantConfig`: S3D8 on
the native CPU kernels, their packed bytes copied into one block of huge-page-advised private memory as the
runtime reads its own files; other formats and devices decoded a block at a time in each forward). The model
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
import logging
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.quantizers import auto as hf_auto
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

# hf_write as a module, not its names: it may be mid-import when transformers loads and runs the registration
# (pipeline/__init__.py) that imports this module
from pipeline import formats
from pipeline.hf import config as hf_config, write as hf_write
from pipeline.hf.config import (BASE_MODEL_TYPES, INDEX_NAME, QUANT_FORMAT, guard_model_type, quant_method,
                                saved_config)
from pipeline.models import checkpoint_names
from pipeline.packed.file import PACKED_VERSION, packed_format, plan_packed, read_metadata
from pipeline.formats.precision import file_formats
from pipeline.packed.modules import DECODES, check_kernel, packed_layer
from pipeline.recipe import replace
from pipeline.packed.safetensors_io import TORCH_DTYPES, PrivateBlock, tensor_specs

_packed = formats.packed


logger = logging.getLogger("transformers.quantizers.s3d8")


# --- the quantization config and quantizer registered with transformers ---------------------------------

# --- the quantization config and quantizer registered with transformers ---------------------------------

KERNELS = ("auto", "torch", "native")


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

    def __init__(self, format: str = formats.SUBJECT, quant_method: str | None = None, layout: str | None = None,
                 version: str | None = None, bits_per_weight: float | None = None,
                 modules_to_not_convert: list[str] | None = None, kernel: str = "auto", decode: str = "lazy",
                 act_quant: bool = True, format_version: str | None = None, formats: dict | None = None,
                 **kwargs) -> None:
        if kwargs:
            raise ValueError(f"quantization_config: unknown field(s) {sorted(kwargs)}")
        fmt = _packed(format, QUANT_FORMAT)          # the argument ``formats`` shadows the registry
        expected = hf_config.quant_method(fmt.name)    # the argument shadows the function
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
        if formats is not None and (not isinstance(formats, dict) or not all(isinstance(k, str) for k in formats)):
            raise ValueError(f"quantization_config.formats is {formats!r}, not a mapping {{weight: format}}")
        for name, other in (formats or {}).items():
            _packed(other, f"quantization_config.formats[{name!r}]")
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
        self.formats = dict(formats) if formats else None

    def get_loading_attributes(self) -> dict:
        return {"kernel": self.kernel, "decode": self.decode, "act_quant": self.act_quant}

    def to_saved_dict(self) -> dict:
        """What ``config.json`` stores: the file's description, not this session's loading options."""
        return saved_config(self.format, self.layout, self.version, self.bits_per_weight,
                            self.modules_to_not_convert, self.formats)

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
        self.kernel = resolve_kernel(cfg.kernel, formats.packed(cfg.format, QUANT_FORMAT), cfg.act_quant,
                                     device_map)

    def update_dtype(self, dtype: torch.dtype) -> torch.dtype:
        self.dtype = dtype
        return dtype

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        cfg = self.quantization_config
        fmt = formats.packed(cfg.format, QUANT_FORMAT)
        if not checkpoint_files:
            raise ValueError("packed models load from files: no checkpoint file was found")
        header: dict[str, tuple[str, list[int]]] = {}
        where: dict[str, str] = {}
        for file in checkpoint_files:
            index = Path(file).parent / INDEX_NAME
            if not Path(file).is_file() and index.is_file():
                raise FileNotFoundError(f"{index}: 'weight_map' names {Path(file).name}, which does not exist")
            tensors, _ = tensor_specs(file)
            header.update(tensors)
            where.update(dict.fromkeys(tensors, file))
        first = checkpoint_files[0]
        config_json = Path(first).parent / "config.json"
        meta = read_metadata(first)
        if meta.get("format") != fmt.name:
            raise ValueError(f"{first}: metadata 'format' is {meta.get('format')!r}, but {config_json} "
                             f"quantization_config.format is {fmt.name!r}")
        packed_format(first, meta, fmt)
        in_file = {k: f.name for k, f in file_formats(first, meta, fmt).items()}
        if in_file != (cfg.formats or {}):
            raise ValueError(f"{first}: metadata 'formats' ({len(in_file)} weights) differs from {config_json} "
                             f"quantization_config.formats ({len(cfg.formats or {})})")
        with torch.device("cpu"):                  # the model is built under a meta-device context
            names = checkpoint_names(model)       # a tied lm_head gets its embedding's name, as the file has it
        plan = plan_packed(first, meta, model, names, fmt, header, where)
        not_converted = set(cfg.modules_to_not_convert or ())
        for p in plan:
            module = model.get_submodule(p.module_name)
            if p.tied:                                     # shares its owner's packed tensors, loaded once
                _untie(model, f"{p.module_name}.weight")
                replace(model, p.module_name, _PackedSlot(module, None, p.shape))
                continue
            if p.saved.removesuffix(".weight") in not_converted:
                raise ValueError(f"{where[p.parts[p.fmt.suffixes[0]]]}: {p.saved!r} is stored packed, but "
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
                       "packed": {p.module_name: p.saved for p in plan}, "file": first,
                       "formats": {p.module_name: p.fmt for p in plan}}
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        cfg = self.quantization_config
        first = self.source.get("file", "the checkpoint")
        fmt_of = self.source["formats"]
        slots = [(n, m) for n, m in model.named_modules() if isinstance(m, _PackedSlot)]
        loaded = {}                   # by checkpoint name: a tied module's slot holds none of its own
        for name, slot in slots:
            tensors = {s: getattr(slot.weight, s, None) for s in fmt_of[name].suffixes}
            if all(t is not None and not t.is_meta for t in tensors.values()):
                loaded[self.source["packed"][name]] = tensors
        # the native kernels stream a Linear's packed bytes: one block of private memory, huge pages advised (an
        # embedding's rows are looked up a few at a time: they stay where transformers put them)
        products = {self.source["packed"][n] for n, m in slots if m.linear} if self.kernel == "native" else set()
        parts = [(saved, s) for saved, tensors in loaded.items() if saved in products for s in tensors]
        block = PrivateBlock([(loaded[saved][s].dtype, tuple(loaded[saved][s].shape)) for saved, s in parts])
        slot_of = {part: i for i, part in enumerate(parts)}
        for name, slot in slots:
            saved = self.source["packed"][name]
            if saved not in loaded:
                raise RuntimeError(f"packed tensors of {name!r} were not loaded")
            for s, t in loaded[saved].items():
                if (saved, s) in slot_of:
                    loaded[saved][s] = block.put(slot_of.pop((saved, s)), t)
            bias = None if slot.bias is None else slot.bias.detach()
            replace(model, name, packed_layer(first, saved, fmt_of[name], loaded[saved], slot.shape, bias, slot.padding_idx,
                                              linear=slot.linear, kernel=self.kernel, decode=cfg.decode,
                                              act_quant=cfg.act_quant, dtype=self.dtype))
        # transformers' save_pretrained would write the model's state dict under a "format: pt" header and
        # the base model_type: save_packed writes the packed directory this model came from instead
        model.save_pretrained = functools.partial(hf_write.save_packed, model)   # survives pickle and deepcopy
        return model

    def is_serializable(self, **kwargs) -> bool:
        # reached only through transformers' own PreTrainedModel.save_pretrained, which would drop the layout
        logger.warning("a packed model is saved by model.save_pretrained(dir) as pipeline.hf.write.save_packed "
                       "installs it at load; call pipeline.hf.write.save_packed(model, dir) directly")
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
        header, meta = tensor_specs(file)
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
                     f"or load the file with pipeline.packed.file.load_packed_model")


def _install_load_check() -> None:
    """Run :func:`_refuse_unloaded` in every ``from_pretrained``, where transformers reads the checkpoint files."""
    from transformers.modeling_utils import PreTrainedModel

    current = inspect.getattr_static(PreTrainedModel, "_load_pretrained_model")
    func = current.__func__ if isinstance(current, staticmethod) else current
    if getattr(func, "_s3d8_checked", False):
        return
    signature = inspect.signature(func)
    if not {"model", "checkpoint_files", "load_config"} <= set(signature.parameters):
        raise RuntimeError(f"pipeline.hf.quantizer: PreTrainedModel._load_pretrained_model{signature} of this transformers "
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


register()

