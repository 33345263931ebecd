"""The teacher: where it comes from (``teacher`` parameters) and how its files are found."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class TeacherParams:
    source: str = "data/toy-teacher"     # a local model directory or a hub id
    dtype: str = "bfloat16"
    name: str = "toy-mllama"             # how reports call it


def local_dir(source: str) -> Path:
    """A local directory holding the teacher's files: ``source`` itself, or the hub snapshot of that id
    (downloaded once into the Hugging Face cache; offline use needs it cached)."""
    path = Path(source)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path}: not a model directory (config.json missing); "
                                    f"run `dvc repro toy-teacher` or set teacher.source")
        return path
    if path.exists() or source.startswith((".", "/")) or source.count("/") != 1:
        raise FileNotFoundError(f"teacher.source {source!r}: no such directory (and not a hub id 'org/name')")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model"]))
    except Exception as e:
        raise FileNotFoundError(f"teacher.source {source!r}: not available ({e}); download it where the "
                                f"hub is reachable and point teacher.source at the directory") from None
