"""Parquet shards: the files stages exchange. Written atomically, with provenance in the schema metadata,
and read back with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.files.hashes import file_hash, file_sha256, fingerprint  # noqa: F401  (also imported from here)
from pipeline.files.atomic import atomic_path

META_KEY = b"s3d8_pipeline"


def write_shard(path: str | Path, table: pa.Table, meta: dict) -> None:
    table = table.replace_schema_metadata({**(table.schema.metadata or {}),
                                           META_KEY: json.dumps(meta, sort_keys=True).encode()})
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def read_shard(path: str | Path, columns: list[str] | None = None) -> tuple[pa.Table, dict]:
    """The table and the provenance metadata of a shard; a missing, truncated or foreign file is a
    ``ValueError`` naming it."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: shard not found")
    try:
        table = pq.read_table(path)
    except Exception as e:
        raise ValueError(f"{path}: not a readable Parquet shard ({e})") from None
    raw = (table.schema.metadata or {}).get(META_KEY)
    if raw is None:
        raise ValueError(f"{path}: not written by this pipeline (no {META_KEY.decode()} metadata)")
    if columns:
        missing = [c for c in columns if c not in table.column_names]
        if missing:
            raise ValueError(f"{path}: missing columns {missing} (has {table.column_names})")
    return table, json.loads(raw)


def shard_paths(directory: str | Path) -> list[Path]:
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: shard directory not found (run the stage that writes it)")
    paths = sorted(directory.glob("shard-*.parquet"))
    if not paths:
        raise ValueError(f"{directory}: no shard-*.parquet files")
    return paths


