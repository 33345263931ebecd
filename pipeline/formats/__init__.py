"""Weight formats, looked up by name: ``pipeline.formats.get("s3d8")``.

Every format offers ``fit(weight, seed=0) -> state``, ``quantize(weight, state) -> Tensor`` (fake
quantised, same shape and dtype, straight-through gradient), ``bits_per_param(shape)`` (nominal, as
the paper counts) and ``storage_bytes(shape)`` (what the packed tensors really take).
"""

from __future__ import annotations

from pipeline.formats.base import Format, State
from pipeline.formats.baseline import BF16, INT8
from pipeline.formats.s3d8 import S3D8
from pipeline.formats.scalar import Int6, LloydMax, StudentT

_FORMATS: dict[str, Format] = {f.name: f for f in (S3D8(), Int6(), StudentT(), LloydMax(), INT8(), BF16())}

QUANTISED = ("s3d8", "int", "student_t", "lloyd_max")
"""The 2.6-2.7-bit formats of the paper's comparison."""


def names() -> list[str]:
    return list(_FORMATS)


def get(name: str) -> Format:
    """The format called ``name``; an unknown name is a ``ValueError`` listing the known ones."""
    try:
        return _FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown format {name!r}; known formats: {', '.join(_FORMATS)}") from None


__all__ = ["Format", "State", "get", "names", "QUANTISED"]
