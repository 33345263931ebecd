"""Hashes of files, for fingerprints and provenance records: a module of its own, so that what imports it (the
direct cast, the packed-model command) needs neither pyarrow nor anything else of the pipeline's extras."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes (hex), read a MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(*parts) -> str:
    """A short stable hash of JSON-serialisable parts (parameters, input hashes)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def file_hash(path: str | Path) -> str:
    """A short stable hash of a file (its sha256's first 16 hex digits), for fingerprints."""
    return file_sha256(path)[:16]


HASH_CACHE = Path("checkpoints/file-hashes.json")


def cached_file_hash(path: str | Path, cache: str | Path = HASH_CACHE) -> str:
    """:func:`file_hash` of ``path``, remembered in the JSON file ``cache`` by the file's resolved path, size and
    modification time: a file unchanged since is not read again (a calibration file of ~55 GB takes minutes)."""
    import os

    path, cache = Path(path).resolve(), Path(cache)
    stat = path.stat()
    key, mark = str(path), [stat.st_size, stat.st_mtime_ns]
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if known.get(key, {}).get("size_mtime") == mark:
        return known[key]["hash"]
    known[key] = {"size_mtime": mark, "hash": file_hash(path)}
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
    os.replace(tmp, cache)
    return known[key]["hash"]
