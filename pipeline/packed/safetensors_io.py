"""Safetensors files, the one place their layout is handled: the dtype names, the header reader and the streaming
writer. The ``safetensors`` package reads tensors (``safe_open``); its writer needs every tensor in memory at
once, so files whose tensors are produced one at a time (an 11B model's, tensor by tensor or a block of rows at a
time) are written here: the header first (every tensor declared up front), then the bytes in that order, atomically
(a temporary file renamed into place) and byte-reproducibly (metadata in sorted order)."""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

from pipeline.files.atomic import atomic_path

DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
    torch.bool: "BOOL",
}
"""Safetensors' dtype names of the torch dtypes this project writes."""
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}

MAX_HEADER_BYTES = 100 * 2**20


def read_header(path: str | os.PathLike) -> tuple[dict[str, dict], dict[str, str], int]:
    """``(entries, metadata, data offset)`` of a safetensors file from its header alone: ``entries`` maps each
    tensor to its ``{"dtype", "shape", "data_offsets"}``. A missing file is a ``FileNotFoundError``; one that is
    not a readable safetensors file, or whose size is not what its header describes, a ``ValueError`` naming it."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(size - 8, MAX_HEADER_BYTES):
                raise ValueError(f"header length {n} is implausible")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        end = max((int(e["data_offsets"][1]) for e in header.values()), default=0)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: file not found") from None
    except (OSError, ValueError, struct.error, TypeError, KeyError, IndexError, AttributeError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e or type(e).__name__})") from None
    if 8 + n + end != size:
        raise ValueError(f"{path}: truncated or corrupt: its header describes {8 + n + end} bytes, the file holds "
                         f"{size}")
    return header, meta, 8 + n


def tensor_specs(path: str | os.PathLike) -> tuple[dict[str, tuple[str, list[int]]], dict[str, str]]:
    """``({tensor: (dtype name, shape)}, metadata)`` of a safetensors file, from :func:`read_header`."""
    entries, meta, _ = read_header(path)
    return {k: (v["dtype"], list(v["shape"])) for k, v in entries.items()}, meta


def private_memory(nbytes: int) -> torch.Tensor:
    """``nbytes`` of private anonymous memory as a uint8 tensor, transparent huge pages advised where the OS has
    them (Linux ``MADV_HUGEPAGE``): a stream over 4 KB pages misses the TLB every 64 cache lines. A page costs
    nothing until it is written."""
    if not hasattr(mmap, "MAP_PRIVATE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    mm = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):   # no such advice on this OS, or transparent huge pages disabled
        pass
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)


class PrivateBlock:
    """One block of :func:`private_memory` (huge pages advised) for tensors of the given ``(dtype, shape)``, each at a
    64-byte aligned offset: what :class:`PrivateReader` gives a file's tensors, for tensors loaded another way (a
    Hugging Face ``from_pretrained``). ``put(i, tensor)`` copies tensor ``i`` in and returns the copy; a slot costs
    nothing until it is written, so tensors copied one at a time, each original dropped after its copy, never sit in
    memory twice."""

    def __init__(self, specs: list[tuple[torch.dtype, tuple[int, ...]]]) -> None:
        self._specs, self._offsets, end = specs, [], 0
        for dtype, shape in specs:
            self._offsets.append(end)
            end += -(-math.prod(shape) * dtype.itemsize // 64) * 64
        self._memory = private_memory(end)

    def put(self, i: int, tensor: torch.Tensor) -> torch.Tensor:
        dtype, shape = self._specs[i]
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"slot {i} holds {dtype} {tuple(shape)}, not {tensor.dtype} {tuple(tensor.shape)}")
        at = self._offsets[i]
        out = self._memory[at:at + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)
        out.copy_(tensor)
        return out


class PrivateReader:
    """A safetensors file's tensors read with plain reads into one block of :func:`private_memory`, each at a
    64-byte aligned offset, on first ``get``: no page of the file is mapped, so resident memory is the tensors
    read, once (a mapped file's pages count beside every copy made of them, in 4 KB pages).

    ``get(name, mapped=True)``: the tensor over a copy-on-write map of the file instead, for a table read a few rows
    at a time (an embedding): a page comes in from the file when a lookup first touches it, and
    :meth:`drop_mapped` hands the pages touched so far back to the page cache (a full pass, such as a check of every
    byte, leaves nothing resident); its block of private memory is never touched."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.entries, self.metadata, self._base = read_header(self.path)
        self._offsets, end = {}, 0
        for name, e in sorted(self.entries.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            self._offsets[name] = end
            end += -(-(e["data_offsets"][1] - e["data_offsets"][0]) // 64) * 64
        self._memory = private_memory(end)
        self._map: mmap.mmap | None = None

    def get(self, name: str, mapped: bool = False) -> torch.Tensor:
        e = self.entries.get(name)
        if e is None:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        a, b = e["data_offsets"]
        dtype = TORCH_DTYPES.get(e["dtype"])
        if dtype is None or math.prod(e["shape"]) * dtype.itemsize != b - a:
            raise ValueError(f"{self.path}: tensor {name!r}: {b - a} bytes of {e['dtype']} for shape {e['shape']}")
        if mapped and b > a and (self._base + a) % dtype.itemsize == 0 and hasattr(mmap, "MADV_DONTNEED"):
            if self._map is None:
                with open(self.path, "rb") as f:
                    self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                self._map.madvise(mmap.MADV_RANDOM)       # rows looked up here and there: no read-ahead
            return torch.frombuffer(self._map, dtype=torch.uint8, count=b - a,
                                    offset=self._base + a).view(dtype).reshape(e["shape"])
        off = self._offsets[name]
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self._base + a)
            got = f.readinto(self._memory[off:off + b - a].numpy()) if b > a else 0
        if got != b - a:
            raise ValueError(f"{self.path}: tensor {name!r} is truncated")
        return self._memory[off:off + b - a].view(dtype).reshape(e["shape"])

    def drop_mapped(self) -> None:
        """Hand back the pages of the mapped tensors touched so far (never written: the file still holds them)."""
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)


class StreamingWriter:
    """Write a safetensors file tensor by tensor, in the order the tensors were declared.

    Declare every tensor's dtype and shape up front (the header comes first), then ``write`` them in
    that order; ``close`` checks that all were written and renames the file into place.
    """

    def __init__(self, path: str | os.PathLike, specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {k: str(metadata[k]) for k in sorted(metadata)}   # same input, same bytes
        self._order: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []
        offset = 0
        for name, dtype, shape in specs:
            if name in header:
                raise ValueError(f"tensor {name!r} declared twice")
            nbytes = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._order.append((name, dtype, tuple(shape), nbytes))
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self._next, self._part = 0, 0
        self._ctx = atomic_path(self.path)
        self._tmp = self._ctx.__enter__()
        self._file = open(self._tmp, "wb")
        self._file.write(struct.pack("<Q", len(blob)) + blob)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._order):
            raise ValueError(f"tensor {name!r} was not declared")
        want, dtype, shape, nbytes = self._order[self._next]
        if self._part:
            raise ValueError(f"tensor {want!r}: written in part, {self._part} of {nbytes} bytes")
        if name != want:
            raise ValueError(f"expected tensor {want!r} next, got {name!r}")
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"tensor {name!r}: declared {dtype} {list(shape)}, got {tensor.dtype} {list(tensor.shape)}")
        data = tensor.detach().contiguous().cpu().reshape(-1)
        self._file.write(data.view(torch.uint8).numpy().tobytes() if nbytes else b"")
        self._next += 1

    def write_part(self, name: str, piece: torch.Tensor) -> None:
        """Bytes of the next declared tensor in pieces, in order (a weight generated a block of rows at a time);
        the tensor is done when its declared size is reached."""
        if self._next >= len(self._order):
            raise ValueError(f"tensor {name!r} was not declared")
        want, dtype, _, nbytes = self._order[self._next]
        if name != want or piece.dtype != dtype:
            raise ValueError(f"expected a piece of {dtype} tensor {want!r} next, got {piece.dtype} {name!r}")
        data = piece.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        self._file.write(data.tobytes())
        self._part += data.size
        if self._part > nbytes:
            raise ValueError(f"tensor {name!r}: more bytes than the {nbytes} declared")
        if self._part == nbytes:
            self._next, self._part = self._next + 1, 0

    def close(self) -> None:
        self._file.close()
        if self._next != len(self._order):
            missing = [n for n, *_ in self._order[self._next:]]
            self._ctx.__exit__(RuntimeError, None, None)
            raise RuntimeError(f"{self.path}: {len(missing)} declared tensors were not written, e.g. {missing[:3]}")
        self._ctx.__exit__(None, None, None)

    def abort(self) -> None:
        self._file.close()
        self._ctx.__exit__(RuntimeError, None, None)

    def __enter__(self) -> "StreamingWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """A small safetensors file, atomically and byte-reproducibly (tensors and metadata in sorted order;
    the ``safetensors`` package orders its metadata differently from run to run)."""
    names = sorted(tensors)
    with StreamingWriter(path, [(n, tensors[n].dtype, tuple(tensors[n].shape)) for n in names], metadata) as w:
        for n in names:
            w.write(n, tensors[n])
