"""Fitted format states (S3D8 tables, code points) of a whole model, stored as safetensors.

A state tensor ``key`` of the module at path ``P`` is stored as ``P.weight.key`` (the packed file's
naming); the file's metadata names the format.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from pipeline.formats import State
from pipeline.io import atomic_path


def save_states(path: str | Path, fmt: str, states: dict[str, State], metadata: dict | None = None) -> None:
    tensors = {f"{module}.weight.{key}": t.contiguous() for module, st in states.items()
               for key, t in st.items()}
    meta = {"format": fmt, "modules": json.dumps(list(states))}
    meta.update({k: str(v) for k, v in (metadata or {}).items()})
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)


def load_states(path: str | Path, fmt: str | None = None) -> dict[str, State]:
    """Read the states saved by :func:`save_states`; ``fmt`` (if given) must match the file's."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: fitted-state file not found (run the fit-centroids stage)")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if fmt is not None and meta.get("format") != fmt:
            raise ValueError(f"{path}: holds the state of format {meta.get('format')!r}, not {fmt!r}")
        states: dict[str, State] = {m: {} for m in json.loads(meta.get("modules", "[]"))}
        for name in f.keys():
            weight, _, key = name.rpartition(".")
            module = weight.removesuffix(".weight")
            states.setdefault(module, {})[key] = f.get_tensor(name)
    return states
