"""Weight formats: the one registry of them. ``pipeline.formats.get("s3d8")`` returns a format object.

Every format offers ``fit(weight, seed=0) -> state``, ``quantize(weight, state) -> Tensor`` (fake
quantised, same shape and dtype, straight-through gradient), ``bits_per_param(shape)`` (nominal, as
the paper counts) and ``storage_bytes(shape)`` (what the packed tensors really take); the formats of
the paper's comparison also their packed tensors (``pack`` / ``unpack`` / ``packed_specs``), their
fitted-state file (``save_states`` / ``load_states``) and their post-training methods and scale rules
(``search``, ``gptq``, ``pack_at_scale``, ``values_at_scale``, ``absmax_scale`` ...; ``pipeline.cast.ptq`` calls
them). Each format lives in its own module (``pipeline/formats/<name>.py``); adding one means writing that module
and listing it here.
"""

from __future__ import annotations

from pipeline.formats.base import Format, FormatBase, State
from pipeline.formats.bf16 import BF16
from pipeline.formats.int import Int
from pipeline.formats.int8 import INT8
from pipeline.formats.lloyd_max import LloydMax
from pipeline.formats.s3d8 import S3D8
from pipeline.formats.student_t import StudentT

_FORMATS: dict[str, FormatBase] = {f.name: f for f in (S3D8(), Int(), StudentT(), LloydMax(), INT8(), BF16())}

QUANTISED = tuple(name for name, f in _FORMATS.items() if f.comparison)
"""The 2.6-2.7-bit formats of the paper's comparison, in the paper's order."""
SUBJECT = S3D8.name
"""The format the project ships (Llama-Mobile's): the one benchmarks set their goals for, the others measured beside
it."""
INT8_BASELINE, BF16_BASELINE = INT8.name, BF16.name
"""The speed baselines (SPEC section 3): per-channel INT8 and the unquantised bf16."""


def names() -> list[str]:
    return list(_FORMATS)


def get(name: str) -> FormatBase:
    """The format called ``name``; an unknown name is a ``ValueError`` listing the known ones."""
    try:
        return _FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown format {name!r}; known formats: {', '.join(_FORMATS)}") from None


def comparison(name: str, what: str = "format") -> FormatBase:
    """The comparison format called ``name``; anything else is a ``ValueError`` naming ``what``."""
    if name not in QUANTISED:
        raise ValueError(f"{what} {name!r}: expected one of {', '.join(QUANTISED)}")
    return _FORMATS[name]


def packable() -> list[FormatBase]:
    """Formats with a packed layout."""
    return [f for f in _FORMATS.values() if f.layout is not None]


def packed(name, what: str = "format") -> FormatBase:
    """The format with a packed layout called ``name`` (read from a file: any value); anything else is a
    ``ValueError`` naming ``what``."""
    known = {f.name: f for f in packable()}
    if not isinstance(name, str) or name not in known:
        raise ValueError(f"{what} is {str(name)[:80]!r}, not one of {sorted(known)}")
    return known[name]


__all__ = ["Format", "FormatBase", "State", "get", "names", "comparison", "packable", "packed", "QUANTISED", "SUBJECT",
           "INT8_BASELINE", "BF16_BASELINE"]


def check_names(value) -> list[str]:
    """The ``formats`` parameter: a non-empty list of distinct comparison formats."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"expected a non-empty list of formats from {list(QUANTISED)}, got {value!r}")
    for name in value:
        comparison(name, "format")
    if len(set(value)) != len(value):
        raise ValueError(f"lists a format twice: {value}")
    return list(value)
