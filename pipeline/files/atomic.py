"""Atomic file output: write to a temporary file beside the target, then rename over it.

A crash never leaves a half-written file that a later stage would trust.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path in the target's directory; rename it onto ``path`` on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):     # left by a killed run
        if stale.is_file():
            stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        if tmp.exists():
            os.chmod(tmp, 0o666 & ~_UMASK)      # mkstemp creates 0600; give the file normal permissions
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``path`` (never inside it, so a DVC directory output never
    holds a stray file); on success it replaces ``path`` whole. Leftovers of a killed run (``.NAME.*.tmp``
    beside it) are swept first, so a rerun leaves nothing behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_UMASK)           # mkdtemp creates 0700
        old = None
        if path.is_dir():
            old = path.with_name(f".{path.name}.old.{os.getpid()}.tmp")
            os.replace(path, old)
        elif path.exists():
            path.unlink()
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", **kwargs: Any) -> Iterator[Any]:
    with atomic_path(path) as tmp, open(tmp, mode, **kwargs) as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def write_json(path: str | os.PathLike, obj: Any) -> None:
    with atomic_open(path) as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_open(path) as f:
        f.write(text)
