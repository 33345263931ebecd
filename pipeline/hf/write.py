"""Writing packed Hugging Face directories: :func:`write_model_dir` (pack-safetensors, ``s3d8 pack``),
:func:`save_packed` (``model.save_pretrained`` of a loaded packed model: the packed bytes it holds, unchanged),
sharding above ``MAX_SHARD_SIZE`` and the model card."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from pipeline import formats
from pipeline.packed.checkpoint import CheckpointReader
from pipeline.hf.config import (BASE_MODEL_TYPES, GUARD_PREFIX, HINT, HINT_KEY, INDEX_NAME, INSTALL, MAX_SHARD_SIZE,
                                MODEL_TYPE, QUANT_FORMAT, WEIGHTS_NAME, guard_model_type, quant_method, saved_config)
from pipeline.packed.file import PACKED_VERSION, bits_two_ways, read_metadata, write_packed
from pipeline.packed.safetensors_io import TORCH_DTYPES, StreamingWriter, tensor_specs


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
    header, meta = tensor_specs(single)
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


def packed_config(config: dict, where, quantization: dict) -> dict:
    """``config.json`` of a packed directory from its base model's: the guard ``model_type``, the
    ``quantization_config`` (:func:`pipeline.hf.config.saved_config`) and the install hint."""
    base = config.get("model_type")
    if base not in BASE_MODEL_TYPES:
        raise ValueError(f"{where}: model_type {base!r}; packed directories are written for "
                         f"{list(BASE_MODEL_TYPES)} (pipeline.hf.config.BASE_MODEL_TYPES)")
    return {**config, "model_type": guard_model_type(base), "quantization_config": quantization,
            HINT_KEY: HINT}


def write_model_dir(out: str | os.PathLike, source: CheckpointReader, fmt, states: dict[str, dict], *,
                    teacher_dir: str | os.PathLike, method: str, base_model: str, teacher_name: str,
                    dtype: torch.dtype = torch.bfloat16, metadata: dict | None = None,
                    max_shard_size: int = MAX_SHARD_SIZE, progress=None, encode=None, other=None) -> dict:
    """Write the Hugging Face directory of one packed model into ``out`` (an empty directory the caller
    makes atomic); ``other``: the precision plan's weights in another format (``write_packed``). Returns
    :func:`write_packed`'s summary with ``file_bytes`` the weight files' total."""
    from transformers import AutoConfig, AutoProcessor, GenerationConfig

    out, teacher_dir = Path(out), Path(teacher_dir)
    config = json.loads((teacher_dir / "config.json").read_text())
    formats.packed(fmt.name)                                  # fail before packing
    packed_config(config, teacher_dir / "config.json", {})
    out.mkdir(parents=True, exist_ok=True)
    summary = write_packed(out / WEIGHTS_NAME, source, fmt, states, dtype=dtype, metadata=metadata, progress=progress,
                           encode=encode, other=other)
    files = shard(out, max_shard_size)
    summary["file_bytes"] = weight_bytes(out)
    summary["files"] = files
    unconverted = sorted(name.removesuffix(".weight") for name in source.keys()
                         if name.endswith(".weight") and len(source.shape(name)) == 2
                         and name.removesuffix(".weight") not in states)
    quantization = saved_config(fmt.name, fmt.layout, PACKED_VERSION, summary["bits_per_param_nominal"], unconverted,
                                {f"{m}.weight": f.name for m, f in (other or {}).items()})
    config = packed_config(config, teacher_dir / "config.json", quantization)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    AutoProcessor.from_pretrained(str(teacher_dir)).save_pretrained(str(out))
    try:
        generation = GenerationConfig.from_pretrained(str(teacher_dir))
    except OSError:
        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(teacher_dir)))
    generation.save_pretrained(str(out))
    (out / "README.md").write_text(model_card(fmt.name, method, _card_summary(read_metadata(out / files[0]), out),
                                              base_model=base_model, teacher_name=teacher_name,
                                              model_type=config["model_type"]))
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


def _check_save_options(kwargs: dict) -> None:
    unknown = sorted(set(kwargs) - set(_SAVE_OPTIONS))
    if unknown:
        raise ValueError(f"save_pretrained of a packed model: option(s) {unknown} are not supported (it writes the "
                         f"packed tensors the model holds; supported: {list(_SAVE_OPTIONS)})")
    if kwargs.get("push_to_hub"):
        raise ValueError("save_pretrained of a packed model: push_to_hub=True is not supported; save to a "
                         "directory, then upload it (huggingface_hub.upload_folder)")
    if kwargs.get("safe_serialization") is False:
        raise ValueError("save_pretrained of a packed model: packed weights are written as safetensors only")


def save_packed(model: nn.Module, save_directory: str | os.PathLike, **kwargs) -> None:
    """``model.save_pretrained(dir)`` of a model ``from_pretrained`` loaded from a packed directory: the
    same packed tensors under the same names, metadata and layout (byte for byte the file it was loaded from,
    if the model is unchanged), ``config.json`` with the guard ``model_type`` and the saved quantization
    config (never the loading options), ``generation_config.json`` and a model card. Nothing is re-quantised:
    a module decoded at load (``decode="eager"``) is an error. Files are written beside and moved into place;
    stale weight files of an earlier save are removed. ``max_shard_size`` (bytes or ``"5GB"``) and
    ``is_main_process`` as in transformers; the processor is saved by ``processor.save_pretrained``."""
    from transformers.utils.hub import convert_file_size_to_int

    _check_save_options(kwargs)
    if not kwargs.get("is_main_process", True):
        return
    max_shard_size = convert_file_size_to_int(kwargs.get("max_shard_size", MAX_SHARD_SIZE))
    quantizer = getattr(model, "hf_quantizer", None)
    if not getattr(quantizer, "source", None):       # what the packed-format quantizer (pipeline.hf.quantizer) records
        raise ValueError("save_packed: the model was not loaded from a packed directory by from_pretrained")
    cfg, source = quantizer.quantization_config, quantizer.source
    fmt = formats.packed(cfg.format, QUANT_FORMAT)
    tensors: dict[str, torch.Tensor] = {}
    for module_name, saved in source["packed"].items():
        parts = _packed_parts(model.get_submodule(module_name), source["formats"].get(module_name, fmt))
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
        config = packed_config(model.config.to_diff_dict(), f"{directory}/config.json", cfg.to_saved_dict())
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
    overrides = summary.get("overrides") or {}
    which = "every linear and embedding weight" if not overrides else \
        f"its linear and embedding weights ({len(overrides)} in another format: the precision plan below)"
    lines += [f"`{base_model}` with {which} in **{f.label}** ({how}), written by s3d8-pipeline.", "",
              "| | |", "| --- | --- |",
              f"| format | {f.label} (`quant_method: {quant_method(fmt)}`, layout `{f.layout}`) |",
              f"| bits per parameter | {summary['bits_per_param_nominal']:.3f} nominal, "
              f"{summary['bits_per_param_actual']:.3f} with padding and tables |"]
    if "bits_per_weight_whole" in summary:
        lines.append(f"| bits per weight | {summary['bits_per_weight_whole']:.2f} whole model, "
                     f"{summary['bits_per_weight_linears']:.2f} decoder Linears (the paper's accounting, without the "
                     f"vocabulary) |")
    if summary.get("rotate"):
        lines.append(f"| rotation | `{summary['rotate']}`: the residual stream rotated before casting (exact; an "
                     f"ordinary checkpoint for transformers) |")
    lines += [f"| quantised parameters | {summary['quantised_params']:,} |",
              f"| weight files | {summary['file_bytes'] / 1e6:,.1f} MB |", ""]
    if overrides:
        lines += ["Precision plan (weights not in " + f.label + "):", "", "| weight | format |", "| --- | --- |"]
        lines += [f"| `{n}` | {formats.get(o).label} |" for n, o in sorted(overrides.items())] + [""]
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
              + (f" ({f.reader} reads {'it' if not overrides else 'its ' + f.label + ' weights'})." if f.reader else "."),
              ""]
    lines += ["## Evaluation", ""]
    key = f"{fmt}-{method}"
    models = (scores or {}).get("models", {})
    if key in models and "scores" not in models[key]:                      # a text model: KL, top-1, perplexity
        lines += ["| model | bits/param | KL to teacher | top-1 agreement | perplexity |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {n} | {m['bpp']:.2f} | {m['kl']:.4f} | {m['top1_agreement']:.3f} | {m['perplexity']:.2f} |"
                  for n, m in models.items() if n == key or m["method"] == "teacher"] + [""]
    elif key in models:
        rows = [(n, m) for n, m in models.items() if n == key or m["method"] == "teacher"]
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
    """What the card says of a packed directory, read from its files: bits both ways, the precision plan's
    weights in another format, the rotation."""
    shapes = json.loads(meta["shapes"])
    overrides = json.loads(meta.get("formats", "{}"))
    fmt_of = {n: formats.get(overrides.get(n, meta["format"])) for n in shapes}
    reader = CheckpointReader(directory)
    specs = [(n, reader.dtype(n), reader.shape(n)) for n in reader.keys() if reader.dtype(n) is not None]
    return {"bits_per_param_nominal": float(meta["bits_per_param_nominal"]),
            "bits_per_param_actual": float(meta["bits_per_param_actual"]),
            "quantised_params": sum(torch.Size(s).numel() for s in shapes.values()),
            "file_bytes": weight_bytes(directory), "overrides": overrides, "rotate": meta.get("rotate"),
            **bits_two_ways(specs, shapes, fmt_of)}


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
