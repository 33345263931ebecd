"""Stage parameters: one section of ``params.yaml`` read into a validated dataclass.

An unknown key, a missing required key or a value of the wrong type is an error that names the key,
in the spirit of nanoGPT's configurator: a typo in ``params.yaml`` or ``-S`` must never be ignored.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ParamsError(ValueError):
    """A parameter is unknown, missing or of the wrong type; the message names it."""


def _check(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            try:
                return _check(value, arg, key)
            except ParamsError:
                continue
        raise ParamsError(f"parameter {key!r}: {value!r} is not of type {tp}")
    if tp is type(None):
        if value is None:
            return None
        raise ParamsError(f"parameter {key!r}: expected null, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ParamsError(f"parameter {key!r}: expected a mapping, got {value!r}")
        return from_dict(tp, value, prefix=key)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ParamsError(f"parameter {key!r}: expected a list, got {value!r}")
        item = args[0] if args else Any
        return [_check(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ParamsError(f"parameter {key!r}: expected a mapping, got {value!r}")
        kt, vt = args if args else (Any, Any)
        return {_check(k, kt, key): _check(v, vt, f"{key}.{k}") for k, v in value.items()}
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


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, rejecting unknown keys and ill-typed values."""
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
            values[name] = _check(data[name], hints[name], key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ParamsError(f"missing required parameter {key!r}")
    return cls(**values)


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


def load(cls: type[T], section: str, path: str | Path = "params.yaml") -> T:
    """Read ``section`` of the YAML file at ``path`` into dataclass ``cls``."""
    path = Path(path)
    if not path.exists():
        raise ParamsError(f"{path}: parameters file not found")
    with path.open() as f:
        doc = yaml.load(f, Loader=_Loader) or {}
    if section not in doc:
        raise ParamsError(f"{path}: no section {section!r}")
    return from_dict(cls, doc[section] or {}, prefix=section)


def load_yaml(path: str | Path) -> dict[str, Any]:
    with Path(path).open() as f:
        return yaml.load(f, Loader=_Loader) or {}


def merge(base: dict[str, Any], overrides: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``base`` with ``overrides`` applied key by key (mappings merge, other values replace).
    An override of a key ``base`` lacks is an error: presets cannot introduce typos."""
    out = dict(base)
    for key, value in overrides.items():
        name = f"{prefix}.{key}" if prefix else key
        if key not in base:
            raise ParamsError(f"preset sets unknown parameter {name!r}")
        if isinstance(value, dict) and isinstance(base[key], dict) and base[key]:
            out[key] = merge(base[key], value, name)
        else:
            out[key] = value
    return out


def apply_preset(preset: str | Path, path: str | Path = "params.yaml") -> dict[str, Any]:
    """Write ``path`` with the overrides of ``preset`` applied; returns the merged parameters."""
    from pipeline.io import write_text

    merged = merge(load_yaml(path), load_yaml(preset))
    header = f"# {Path(path).name} with the preset {Path(preset).name} applied (python -m pipeline.params apply)\n"
    write_text(path, header + yaml.safe_dump(merged, sort_keys=False, default_flow_style=None, width=110))
    return merged


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pipeline.params",
                                     description="Apply a parameter preset (configs/*.yaml) to params.yaml.")
    sub = parser.add_subparsers(dest="command", required=True)
    apply = sub.add_parser("apply", help="merge a preset's overrides into params.yaml")
    apply.add_argument("preset")
    apply.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    try:
        apply_preset(args.preset, args.params)
    except (ParamsError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    print(f"{args.params}: applied {args.preset}")


if __name__ == "__main__":
    main()
