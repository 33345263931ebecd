"""Image pools for prompt sampling: where the teacher's training images come from.

A pool is named by a spec string (the ``sample.images`` parameter):

- ``toy``: procedurally generated toy-world images from the training split only; the held-out scenes
  the evaluation draws are never produced here (registered by ``pipeline.toy``, see :func:`register`).
- ``folder:PATH``: every image file under a directory (e.g. an ImageNet train folder).
- ``hf:DATASET[:SPLIT[:COLUMN]]``: an image column of a ``datasets`` data set (a hub id or a local path).

Each image has a reference string that the Parquet shards store, and :func:`load_image` turns a
reference back into the image, so the shards stay small and the images exact.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from PIL import Image

_GENERATED: dict[str, Callable[[int, int], Image.Image]] = {}


def register(kind: str, image: Callable[[int, int], Image.Image]) -> None:
    """A generated pool ``kind``: its references are ``kind:SEED:INDEX`` and ``image(seed, index)`` draws one."""
    _GENERATED[kind] = image

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".JPEG"}


def image_refs(spec: str, n: int, seed: int) -> list[str]:
    """``n`` image references from the pool ``spec``, drawn with a seeded shuffle (cycling if the pool
    is smaller than ``n``)."""
    kind, _, rest = spec.partition(":")
    if kind in _GENERATED and not rest:
        return [f"{kind}:{seed}:{i}" for i in range(n)]
    if kind == "folder":
        root = Path(rest)
        if not root.is_dir():
            raise FileNotFoundError(f"image pool {spec!r}: directory {root} not found")
        files = sorted(str(p) for p in root.rglob("*") if p.suffix in IMAGE_SUFFIXES)
        if not files:
            raise ValueError(f"image pool {spec!r}: no image files under {root}")
        return [f"file:{f}" for f in _draw(files, n, seed)]
    if kind == "hf":
        dataset, split, column = _hf_parts(rest)
        size = len(_hf_dataset(dataset, split))
        indices = _draw(list(range(size)), n, seed)
        return [f"hf:{dataset}:{split}:{column}:{i}" for i in indices]
    raise ValueError(f"image pool {spec!r}: expected one of {sorted(_GENERATED)}, 'folder:PATH' or "
                     f"'hf:DATASET[:SPLIT[:COLUMN]]' (generated pools are known once their module is imported, "
                     f"e.g. pipeline.toy)")


def _draw(items: list, n: int, seed: int) -> list:
    rng = random.Random(seed)
    out: list = []
    while len(out) < n:
        order = list(items)
        rng.shuffle(order)
        out.extend(order[: n - len(out)])
    return out


def _hf_parts(rest: str) -> tuple[str, str, str]:
    parts = rest.split(":")
    return parts[0], parts[1] if len(parts) > 1 and parts[1] else "train", parts[2] if len(parts) > 2 else "image"


@lru_cache(maxsize=4)
def _hf_dataset(dataset: str, split: str):
    import datasets

    path = Path(dataset)
    try:
        if path.is_file() or (path.is_dir() and any(path.glob("*.parquet"))):
            files = str(path) if path.is_file() else str(path / "*.parquet")
            return datasets.load_dataset("parquet", data_files=files, split="train")
        return datasets.load_dataset(dataset, split=split)
    except Exception as e:
        raise FileNotFoundError(f"image pool 'hf:{dataset}': cannot load split {split!r} ({e}); give a hub id "
                                f"reachable from here or a local directory / Parquet file") from None


def check_in_pool(ref: str, pool: str) -> None:
    """A ``ValueError`` unless the reference ``ref`` names an image of the pool ``pool`` (a spec string as
    :func:`image_refs` takes): a generated pool's own kind; for ``folder:PATH`` a ``file:`` reference
    whose real path (symlinks and ``..`` resolved) lies under the folder; for ``hf:DATASET[:SPLIT...]``
    an ``hf:`` reference to the same data set and split."""
    if not isinstance(ref, str):
        raise ValueError(f"image reference {ref!r}: expected a string")
    kind, _, rest = ref.partition(":")
    pool_kind, _, pool_rest = pool.partition(":")
    if pool_kind in _GENERATED and not pool_rest:
        if kind != pool_kind:
            raise ValueError(f"image reference {ref[:200]!r} is outside the image pool {pool!r}")
        return
    if pool_kind == "folder":
        if kind != "file":
            raise ValueError(f"image reference {ref[:200]!r} is outside the image pool {pool!r} (expected file:PATH)")
        root = Path(pool_rest).resolve()
        target = Path(rest).resolve()
        if not target.is_relative_to(root):
            raise ValueError(f"image reference {ref[:200]!r} resolves to {target}, outside the image pool folder {root}")
        return
    if pool_kind == "hf":
        dataset, split, _ = _hf_parts(pool_rest)
        ref_dataset, ref_split, _, _ = _hf_ref_parts(ref)
        if (ref_dataset, ref_split) != (dataset, split):
            raise ValueError(f"image reference {ref[:200]!r} is outside the image pool {pool!r} "
                             f"(data set {dataset!r}, split {split!r})")
        return
    raise ValueError(f"image pool {pool!r}: expected one of {sorted(_GENERATED)}, 'folder:PATH' or "
                     f"'hf:DATASET[:SPLIT[:COLUMN]]'")


def _hf_ref_parts(ref: str) -> tuple[str, str, str, int]:
    parts = ref.partition(":")[2].rsplit(":", 3)
    if len(parts) != 4 or not parts[0] or not parts[3].isdigit():
        raise ValueError(f"image reference {ref[:200]!r}: expected hf:DATASET:SPLIT:COLUMN:INDEX")
    return parts[0], parts[1], parts[2], int(parts[3])


def load_image(ref: str, pool: str | None = None) -> Image.Image:
    """The RGB image behind a reference produced by :func:`image_refs`. With ``pool`` (the spec of the
    pool the reference was drawn from) a reference outside that pool is a ``ValueError``
    (:func:`check_in_pool`); without it any reference is followed."""
    if pool is not None:
        check_in_pool(ref, pool)
    if not isinstance(ref, str):
        raise ValueError(f"image reference {ref!r}: expected a string")
    kind, _, rest = ref.partition(":")
    if kind in _GENERATED:
        try:
            seed, index = (int(v) for v in rest.split(":"))
        except ValueError:
            raise ValueError(f"image reference {ref!r}: expected {kind}:SEED:INDEX") from None
        return _GENERATED[kind](seed, index)
    if kind == "file":
        try:
            with Image.open(rest) as im:
                return im.convert("RGB")
        except (OSError, ValueError) as e:
            raise ValueError(f"image {rest}: cannot be read ({e})") from None
    if kind == "hf":
        dataset, split, column, index = _hf_ref_parts(ref)
        data = _hf_dataset(dataset, split)
        if index >= len(data):
            raise ValueError(f"image reference {ref!r}: index {index} past the end of the data set ({len(data)} rows)")
        row = data[index]
        if column not in row:
            raise ValueError(f"image pool 'hf:{dataset}': no column {column!r} (columns: {sorted(row)})")
        return row[column].convert("RGB")
    raise ValueError(f"image reference {ref!r}: unknown kind {kind!r}")
