"""One section of ``params.yaml`` read into a validated dataclass: the fields' checks, the reader and the project's
defaults. The schemas live beside the code that reads them and import this module; :mod:`pipeline.params`, above
them, validates the whole file.

An unknown key, a missing key or a value of the wrong type is an error that names the key, in the spirit of
nanoGPT's configurator: a typo in ``params.yaml`` or ``-S`` must never be ignored. ``params.yaml`` is the only
home of every default: a schema's fields have none, and code outside a stage (tests, benchmarks) builds a
section from the project's file with :func:`defaults`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ParamsError(ValueError):
    """A parameter is unknown, missing or of the wrong type; the message names it."""


def check(value: Any, tp: Any, key: str) -> Any:
    """``value`` checked against the type ``tp`` (a dataclass built from a mapping, lists and mappings item by item);
    ``key`` names it in the error."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            try:
                return check(value, arg, key)
            except ParamsError:
                continue
        raise ParamsError(f"parameter {key!r}: {value!r} is not of type {tp}")
    if tp is type(None):
        if value is None:
            return None
        raise ParamsError(f"parameter {key!r}: expected null, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):            # already built (an override passed to :func:`defaults`)
            return value
        if not isinstance(value, dict):
            raise ParamsError(f"parameter {key!r}: expected a mapping, got {value!r}")
        return from_dict(tp, value, prefix=key)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ParamsError(f"parameter {key!r}: expected a list, got {value!r}")
        item = args[0] if args else Any
        return [check(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ParamsError(f"parameter {key!r}: expected a mapping, got {value!r}")
        kt, vt = args if args else (Any, Any)
        return {check(k, kt, key): check(v, vt, f"{key}.{k}") for k, v in value.items()}
    if origin is typing.Literal:
        if value in args:
            return value
        raise ParamsError(f"parameter {key!r}: {value!r} is not one of {list(args)}")
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ParamsError(f"parameter {key!r}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ParamsError(f"parameter {key!r}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ParamsError(f"parameter {key!r}: expected true/false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ParamsError(f"parameter {key!r}: expected a string, got {value!r}")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ParamsError(f"parameter {key!r}: expected {tp.__name__}, got {value!r}")
    return value


def bounded(default: Any = dataclasses.MISSING, *, ge: float | None = None, gt: float | None = None,
            le: float | None = None) -> Any:
    """A dataclass field whose value (when not None) must lie in the given range; ``from_dict`` checks it.
    A section of ``params.yaml`` gives no ``default`` (the file holds it); other files' schemas may."""
    return dataclasses.field(default=default, metadata={"ge": ge, "gt": gt, "le": le})


def positive(default: Any = dataclasses.MISSING) -> Any:
    return bounded(default, gt=0)


def non_negative(default: Any = dataclasses.MISSING) -> Any:
    return bounded(default, ge=0)


def probability(default: Any = dataclasses.MISSING) -> Any:
    return bounded(default, ge=0, le=1)


def check_range(value: Any, meta: typing.Mapping, key: str) -> None:
    numbers = value if isinstance(value, list) else [value]
    for v in numbers:
        if isinstance(v, float) and not math.isfinite(v):
            raise ParamsError(f"parameter {key!r}: {v!r} is not a finite number")
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        if meta.get("ge") is not None and v < meta["ge"]:
            raise ParamsError(f"parameter {key!r}: {v!r} must be >= {meta['ge']}")
        if meta.get("gt") is not None and v <= meta["gt"]:
            raise ParamsError(f"parameter {key!r}: {v!r} must be > {meta['gt']}")
        if meta.get("le") is not None and v > meta["le"]:
            raise ParamsError(f"parameter {key!r}: {v!r} must be <= {meta['le']}")


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, rejecting unknown keys, ill-typed values, non-finite numbers and
    values outside a field's range (:func:`bounded`)."""
    if not isinstance(data, dict):
        raise ParamsError(f"parameter {prefix or 'file'!r}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        names = ", ".join(f"{prefix}.{k}" if prefix else k for k in unknown)
        raise ParamsError(f"unknown parameter(s) {names}; known: {sorted(fields)}")
    values = {}
    for name, field in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        if name in data:
            values[name] = check(data[name], hints[name], key)
            check_range(values[name], field.metadata, key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ParamsError(f"missing parameter {key!r}")
    try:
        return cls(**values)
    except (ValueError, TypeError) as e:       # a dataclass's own cross-field checks
        if isinstance(e, ParamsError):
            raise
        raise ParamsError(f"parameters {prefix or cls.__name__}: {e}") from None


class _Loader(yaml.SafeLoader):
    """PyYAML reads YAML 1.1, where ``3e-05`` (what ``dvc exp run -S qat.lr=3e-5`` writes) is a string; DVC
    reads YAML 1.2, where it is a float. Resolve floats as YAML 1.2 does, so both agree."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                    |[-+]?\.(?:inf|Inf|INF)
                    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


PROJECT_PARAMS = Path(__file__).resolve().parents[1] / "params.yaml"
"""The project's parameters file: the defaults of every section."""


def defaults(cls: type[T], section: str, path: str | Path = PROJECT_PARAMS, **overrides: Any) -> T:
    """``cls`` filled from ``section`` of ``path`` (dotted for a subsection: ``toy_teacher.model``), with
    ``overrides`` replacing keys; checked as :func:`from_dict` checks a stage's section."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{path}: parameters file not found (the defaults of section {section!r})")
    node: Any = load_yaml(path)
    for part in section.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ParamsError(f"{path}: no section {section!r}")
        node = node[part]
    return from_dict(cls, {**node, **overrides}, prefix=section)


def load_yaml(path: str | Path) -> dict[str, Any]:
    with Path(path).open() as f:
        return yaml.load(f, Loader=_Loader)
