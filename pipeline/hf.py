"""Hugging Face model directories of packed models: write them, and load them with ``from_pretrained``.

A packed model directory (``models/packed/<format>/<method>/``) holds ``config.json`` (the teacher's config
with ``model_type`` :data:`MODEL_TYPE` and a ``quantization_config``), the processor files,
``generation_config.json``, a model card ``README.md`` and the packed weights of SPEC section 7:
``model.safetensors`` (exactly what :func:`pipeline.packed.write_packed` writes, so the Llama-Mobile
reference loader and :func:`pipeline.packed.load_packed_model` read it as before) or, above
``max_shard_size``, shards of the same tensors and metadata listed in ``model.safetensors.index.json``.

Once ``pipeline`` is imported (see ``pipeline/__init__.py``), ``AutoModelForImageTextToText.from_pretrained(dir)``
builds the Mllama model on ``meta``, puts a placeholder holding the packed tensors of every quantised module
in place, lets transformers load the file, then decodes the weights: the logits equal those of
``load_packed_model(dir / "model.safetensors")`` bit for bit. ``quantization_config=PackedQuantConfig(kernel=
"native")`` with ``device_map="cpu"`` runs S3D8 on the native kernels instead.

Plain transformers (``pipeline`` not imported) does not know :data:`MODEL_TYPE` and raises at once: an
unknown ``quant_method`` alone only makes it warn and load random weights (tested), so the config's
``model_type`` is the guard; with ``pipeline`` imported it reads as ``mllama``.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, MllamaConfig
from transformers.quantizers import auto as hf_auto
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from pipeline import formats
from pipeline.checkpoint import CheckpointReader, StreamingWriter, module_to_checkpoint_names
from pipeline.packed import (KERNELS, PACKED_VERSION, PackedEmbedding, PackedLinear, check_kernel, read_metadata,
                             write_packed)
from pipeline.recipe import quantised_modules, replace

MODEL_TYPE = "s3d8-pipeline-mllama"
"""``model_type`` of a packed directory's ``config.json``: unknown to plain transformers (a loud error),
read as ``mllama`` once ``pipeline`` is imported."""
BASE_MODEL_TYPE = "mllama"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MAX_SHARD_SIZE = 5 * 10**9
"""Bytes above which the packed weights are sharded (Llama 3.2 11B Vision in S3D8, about 3.6 GB, stays one
file, the reference's layout). Not a parameter in ``params.yaml``: it changes the layout, not a result."""

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
           "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
           "BOOL": torch.bool}


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
    path = Path(path)
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 * 2**20:
                raise ValueError(f"header length {n} is implausible")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: file not found") from None
    except (OSError, ValueError, struct.error) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    meta = header.pop("__metadata__", None) or {}
    return {k: (v["dtype"], list(v["shape"])) for k, v in header.items()}, meta


# --- the quantization config and quantizer registered with transformers ---------------------------------

class PackedQuantConfig(QuantizationConfigMixin):
    """``quantization_config`` of a packed directory. Saved fields: ``quant_method``, ``format``, ``layout``,
    ``format_version``; loading options (``from_pretrained(..., quantization_config=PackedQuantConfig(...))``
    overrides only these): ``kernel`` (``"torch"``: weights decoded once, any device; ``"native"``: S3D8 on
    the native CPU kernels, needs ``device_map="cpu"``) and ``act_quant`` (INT8 activations per token)."""

    def __init__(self, format: str = "s3d8", quant_method: str | None = None, layout: str | None = None,
                 format_version: str = PACKED_VERSION, kernel: str = "torch", act_quant: bool = True, **kwargs) -> None:
        if kwargs:
            raise ValueError(f"quantization_config: unknown field(s) {sorted(kwargs)}")
        fmt = _packable(format)
        expected = _method_of(fmt.name)
        if quant_method is not None and quant_method != expected:
            raise ValueError(f"quantization_config.quant_method is {quant_method!r} but its format {fmt.name!r} "
                             f"is loaded by quant_method {expected!r}")
        if layout is not None and layout != fmt.layout:
            raise ValueError(f"quantization_config.layout is {layout!r}, format {fmt.name!r} has {fmt.layout!r}")
        if str(format_version) != PACKED_VERSION:
            raise ValueError(f"quantization_config.format_version is {format_version!r}; this reader knows "
                             f"{PACKED_VERSION!r}")
        if kernel not in KERNELS:
            raise ValueError(f"quantization_config.kernel is {kernel!r}, not one of {list(KERNELS)}")
        if not isinstance(act_quant, bool):
            raise ValueError(f"quantization_config.act_quant is {act_quant!r}, not true/false")
        self.quant_method = expected
        self.format = fmt.name
        self.layout = fmt.layout
        self.format_version = PACKED_VERSION
        self.kernel = kernel
        self.act_quant = act_quant

    def get_loading_attributes(self) -> dict:
        return {"kernel": self.kernel, "act_quant": self.act_quant}

    def to_saved_dict(self) -> dict:
        """What ``config.json`` stores: the file's description, not this session's loading options."""
        return {"quant_method": self.quant_method, "format": self.format, "layout": self.layout,
                "format_version": self.format_version}


class _PackedParts(nn.Module):
    """The packed tensors of one weight as buffers, so that the state-dict names are ``P.weight.<suffix>``."""


class _PackedSlot(nn.Module):
    """Stands in for a quantised module between model construction (on meta) and the end of loading."""

    def __init__(self, module: nn.Module, specs: dict[str, tuple[torch.dtype, list[int]]], shape: tuple[int, int]):
        super().__init__()
        self.weight = _PackedParts()
        for suffix, (dtype, sh) in specs.items():
            self.weight.register_buffer(suffix, torch.empty(sh, dtype=dtype, device="meta"))
        self.linear = isinstance(module, nn.Linear)
        self.bias = module.bias if self.linear else None
        self.padding_idx = None if self.linear else module.padding_idx
        self.shape = shape

    def forward(self, *args, **kwargs):
        raise RuntimeError("packed weights were not decoded (the model was not loaded by from_pretrained)")


class PackedHfQuantizer(HfQuantizer):
    """Loads a packed directory: placeholders on meta before loading, decoded modules after."""

    requires_calibration = True          # packed files only: there is no on-the-fly quantisation

    def __init__(self, quantization_config: PackedQuantConfig, **kwargs) -> None:
        super().__init__(quantization_config, **kwargs)
        self.dtype = torch.float32

    def validate_environment(self, device_map=None, **kwargs) -> None:
        cfg = self.quantization_config
        fmt = _packable(cfg.format)
        check_kernel(cfg.kernel, fmt, cfg.act_quant)
        if cfg.kernel == "native":
            devices = set(device_map.values()) if isinstance(device_map, dict) else {device_map}
            if not devices <= {None, "cpu", torch.device("cpu")}:
                raise ValueError(f"kernel 'native' runs on the CPU: load with device_map='cpu' (got {device_map!r})")

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
        if meta.get("layout") != fmt.layout or meta.get("format_version") != PACKED_VERSION:
            raise ValueError(f"{first}: metadata 'layout'/'format_version' are {meta.get('layout')!r}/"
                             f"{meta.get('format_version')!r}, expected {fmt.layout!r}/{PACKED_VERSION!r}")
        try:
            shapes = json.loads(meta.get("shapes", "{}"))
        except json.JSONDecodeError:
            raise ValueError(f"{first}: metadata 'shapes' is not JSON") from None
        with torch.device("cpu"):                  # the model is built under a meta-device context
            names = module_to_checkpoint_names(model)
        expected = {saved for saved in names.values()}
        for module_name, module in list(quantised_modules(model)):
            saved = names[f"{module_name}.weight"]
            parts = {s: f"{saved}.{s}" for s in fmt.suffixes}
            if parts[fmt.suffixes[0]] not in header:
                continue                                   # stored unquantised: loaded as it is
            for key in parts.values():
                if key not in header:
                    raise ValueError(f"{where[parts[fmt.suffixes[0]]]}: tensor {key!r} is missing "
                                     f"(the other parts of {saved!r} are there)")
            shape = tuple(shapes.get(saved, module.weight.shape))
            if shape != tuple(module.weight.shape):
                raise ValueError(f"{first}: metadata 'shapes' gives {saved!r} the shape {list(shape)}, the model "
                                 f"({config_json}) expects {list(module.weight.shape)}")
            specs = {}
            for s, key in parts.items():
                dtype = header[key][0]
                if dtype not in _DTYPES:
                    raise ValueError(f"{where[key]}: tensor {key!r} has dtype {dtype}")
                specs[s] = (_DTYPES[dtype], header[key][1])
            replace(model, module_name, _PackedSlot(module, specs, shape))
            expected.discard(saved)
            expected.update(parts.values())
        unknown = sorted(set(header) - expected)
        if unknown:
            raise ValueError(f"{where[unknown[0]]}: tensor {unknown[0]!r} does not belong to this model "
                             f"({len(unknown)} such tensors)")
        missing = sorted(expected - set(header))
        if missing:
            raise ValueError(f"{first}: {len(missing)} tensors the model ({config_json}) needs are missing, "
                             f"e.g. {missing[:3]}")
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        cfg = self.quantization_config
        fmt = _packable(cfg.format)
        for name, slot in [(n, m) for n, m in model.named_modules() if isinstance(m, _PackedSlot)]:
            tensors = {s: getattr(slot.weight, s) for s in fmt.suffixes}
            if any(t.is_meta for t in tensors.values()):
                raise RuntimeError(f"packed tensors of {name!r} were not loaded")
            bias = None if slot.bias is None else slot.bias.detach()
            if slot.linear and cfg.kernel == "native":
                layer = fmt.native_linear({s: t.cpu() for s, t in tensors.items()}, slot.shape, bias)
            else:
                try:
                    weight = fmt.unpack(tensors, slot.shape).to(self.dtype)
                except ValueError as e:
                    raise ValueError(f"packed tensors of {name!r}: {e}") from None
                layer = (PackedLinear(weight, bias, cfg.act_quant) if slot.linear
                         else PackedEmbedding(weight, slot.padding_idx))
            replace(model, name, layer)
        return model

    def is_serializable(self, **kwargs) -> bool:
        return False          # the packed directory is the artefact; a loaded model is not saved back

    @property
    def is_trainable(self) -> bool:
        return False


class _ModelTypeGuard(MllamaConfig):
    """Reads a packed directory's ``config.json`` (``model_type`` :data:`MODEL_TYPE`) as an ``MllamaConfig``."""

    model_type = MODEL_TYPE

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        return MllamaConfig.from_dict({**config_dict, "model_type": BASE_MODEL_TYPE}, **kwargs)


def register() -> None:
    """Register the config, quantizer and model type with transformers (idempotent)."""
    for f in formats.packable():
        method = quant_method(f.name)
        if method not in hf_auto.AUTO_QUANTIZATION_CONFIG_MAPPING:
            hf_auto.register_quantization_config(method)(PackedQuantConfig)
        if method not in hf_auto.AUTO_QUANTIZER_MAPPING:
            hf_auto.register_quantizer(method)(PackedHfQuantizer)
    if PackedQuantConfig not in hf_auto.LOADING_ATTRIBUTES_CONFIG_TYPES:
        # from_pretrained(quantization_config=PackedQuantConfig(kernel=...)) then overrides the loading options
        hf_auto.LOADING_ATTRIBUTES_CONFIG_TYPES = (*hf_auto.LOADING_ATTRIBUTES_CONFIG_TYPES, PackedQuantConfig)
    AutoConfig.register(MODEL_TYPE, _ModelTypeGuard, exist_ok=True)


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
        return int(torch.Size(shape).numel()) * torch.empty(0, dtype=_DTYPES[dtype]).element_size()

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
        specs = [(n, _DTYPES[header[n][0]], tuple(header[n][1])) for n in names]
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


def write_model_dir(out: str | os.PathLike, source: CheckpointReader, fmt, states: dict[str, dict], *,
                    teacher_dir: str | os.PathLike, method: str, base_model: str, teacher_name: str,
                    dtype: torch.dtype = torch.bfloat16, metadata: dict | None = None,
                    max_shard_size: int = MAX_SHARD_SIZE, progress=None, encode=None) -> dict:
    """Write the Hugging Face directory of one packed model into ``out`` (an empty directory the caller
    makes atomic). Returns :func:`write_packed`'s summary with ``file_bytes`` the weight files' total."""
    from transformers import AutoProcessor, GenerationConfig

    out, teacher_dir = Path(out), Path(teacher_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = write_packed(out / WEIGHTS_NAME, source, fmt, states, dtype=dtype, metadata=metadata, progress=progress,
                           encode=encode)
    files = shard(out, max_shard_size)
    summary["file_bytes"] = weight_bytes(out)
    summary["files"] = files
    config = json.loads((teacher_dir / "config.json").read_text())
    if config.get("model_type") != BASE_MODEL_TYPE:
        raise ValueError(f"{teacher_dir / 'config.json'}: model_type {config.get('model_type')!r}, expected "
                         f"{BASE_MODEL_TYPE!r}")
    config["model_type"] = MODEL_TYPE
    config["quantization_config"] = PackedQuantConfig(format=fmt.name).to_saved_dict()
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    AutoProcessor.from_pretrained(str(teacher_dir)).save_pretrained(str(out))
    try:
        generation = GenerationConfig.from_pretrained(str(teacher_dir))
    except OSError:
        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(teacher_dir)))
    generation.save_pretrained(str(out))
    (out / "README.md").write_text(model_card(fmt.name, method, summary, base_model=base_model,
                                              teacher_name=teacher_name))
    return summary


# --- the model card -------------------------------------------------------------------------------------

def _is_hub_id(source: str) -> bool:
    return not Path(source).exists() and source.count("/") == 1 and not source.startswith((".", "/"))


def model_card(fmt: str, method: str, summary: dict, *, base_model: str, teacher_name: str,
               scores: dict | None = None) -> str:
    """README.md with Hugging Face metadata. ``scores``: ``reports/eval.json``'s content, or None (pack-safetensors
    runs before eval, so the card it writes says where the scores are; :func:`fill_card` adds them later)."""
    f = formats.get(fmt)
    hub = _is_hub_id(base_model)
    license_ = "llama3.2" if "llama" in base_model.lower() else "other"
    lines = ["---"]
    if hub:
        lines += [f"base_model: {base_model}", "base_model_relation: quantized"]
    lines += [f"license: {license_}", "library_name: transformers", "pipeline_tag: image-text-to-text", "tags:"]
    lines += [f"- {t}" for t in ("s3d8-pipeline", "quantized", f"{fmt}", method, "mllama", "image-text-to-text")]
    lines += ["---", "", f"# {teacher_name}: {f.label} ({method})", ""]
    how = "cast directly from the teacher" if method == "direct-cast" else \
        "after quantisation-aware distillation from the teacher"
    lines += [f"`{base_model}` with every linear and embedding weight in **{f.label}** ({how}), written by the "
              f"`pack-safetensors` stage of s3d8-pipeline.", "",
              "| | |", "| --- | --- |",
              f"| format | {f.label} (`quant_method: {quant_method(fmt)}`, layout `{f.layout}`) |",
              f"| bits per parameter | {summary['bits_per_param_nominal']:.3f} nominal, "
              f"{summary['bits_per_param_actual']:.3f} with padding and tables |",
              f"| quantised parameters | {summary['quantised_params']:,} |",
              f"| weight files | {summary['file_bytes'] / 1e6:,.1f} MB |", ""]
    lines += ["## Loading", "",
              "```python",
              "import pipeline  # registers the packed format with transformers (pip install s3d8-pipeline)",
              "from transformers import AutoModelForImageTextToText, AutoProcessor",
              "",
              'model = AutoModelForImageTextToText.from_pretrained("path/to/this/directory")',
              'processor = AutoProcessor.from_pretrained("path/to/this/directory")',
              "```", "",
              f"Without `import pipeline`, transformers stops with an error about the model type `{MODEL_TYPE}` "
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


def fill_card(directory: str | os.PathLike, eval_json: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Rewrite a packed directory's card with the scores of ``eval_json`` (run after eval, outside the DVC
    graph, e.g. on a copy before publishing: writing into ``models/packed`` changes a DVC output)."""
    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no packed weights")
    meta = read_metadata(files[0])
    scores = json.loads(Path(eval_json).read_text())
    summary = {"bits_per_param_nominal": float(meta["bits_per_param_nominal"]),
               "bits_per_param_actual": float(meta["bits_per_param_actual"]),
               "quantised_params": sum(torch.Size(s).numel() for s in json.loads(meta["shapes"]).values()),
               "file_bytes": weight_bytes(directory)}
    text = model_card(meta["format"], meta.get("method", directory.name), summary,
                      base_model=meta.get("source_model", "unknown"), teacher_name=meta.get("teacher", "model"),
                      scores=scores)
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
