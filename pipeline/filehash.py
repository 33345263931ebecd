"""Hashes of files, for fingerprints and provenance records: a module of its own, so that what imports it (the
direct cast, the packed-model command) needs neither pyarrow nor anything else of the pipeline's extras."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes (hex), read a MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_hash(path: str | Path) -> str:
    """A short stable hash of a file (its sha256's first 16 hex digits), for fingerprints."""
    return file_sha256(path)[:16]
