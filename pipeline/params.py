"""Stage parameters: one section of ``params.yaml`` read into a validated dataclass.

An unknown key, a missing key or a value of the wrong type is an error that names the key, in the spirit of
nanoGPT's configurator: a typo in ``params.yaml`` or ``-S`` must never be ignored. ``params.yaml`` is the only
home of every default: a schema's fields have none, and code outside a stage (tests, benchmarks) builds a
section from the project's file with :func:`defaults`.
"""

from __future__ import annotations

import dataclasses
import importlib
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
        if isinstance(value, tp):            # already built (an override passed to :func:`defaults`)
            return value
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


def _check_range(value: Any, meta: typing.Mapping, key: str) -> None:
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
            values[name] = _check(data[name], hints[name], key)
            _check_range(values[name], field.metadata, key)
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


SECTIONS: dict[str, str] = {
    "toy_teacher": "pipeline.toy.settings:ToyTeacherParams",
    "teacher": "pipeline.teacher_source:TeacherParams",
    "formats": "pipeline.formats:check_names",
    "heldout_prompts": "pipeline.answers:check_heldout",
    "fit": "pipeline.fit:FitParams",
    "sample": "pipeline.sample:SampleParams",
    "generate": "pipeline.teacher_generate:GenerateParams",
    "calibrate": "pipeline.calibrate:CalibrateParams",
    "qat": "pipeline.qat.train:QATParams",
    "pack": "pipeline.ptq:PackParams",
    "eval": "pipeline.eval.suite:EvalParams",
    "bench": "pipeline.bench:BenchParams",
    "launch": "pipeline.processes:LaunchParams",
}
"""Every key of ``params.yaml`` and the schema that validates it (imported only to validate)."""


def schema(section: str) -> Any:
    module, _, name = SECTIONS[section].partition(":")
    return getattr(importlib.import_module(module), name)


def validate(doc: Any, path: str | Path = "params.yaml") -> dict[str, Any]:
    """Check every top-level key and section of a parameters document; returns ``{section: value}``."""
    if not isinstance(doc, dict):
        raise ParamsError(f"{path}: expected a mapping of sections at the top level, got {type(doc).__name__}")
    unknown = sorted(set(doc) - set(SECTIONS))
    if unknown:
        raise ParamsError(f"{path}: unknown top-level key(s) {unknown}; known: {sorted(SECTIONS)}")
    missing = sorted(set(SECTIONS) - set(doc))
    if missing:
        raise ParamsError(f"{path}: missing section(s) {missing}")
    out = {}
    for section, value in doc.items():
        tp = schema(section)
        out[section] = from_dict(tp, value, prefix=section) if dataclasses.is_dataclass(tp) else _check_value(tp, value, section)
    return out


def _check_value(tp: Any, value: Any, key: str) -> Any:
    """A top-level value: ``tp`` is a type, or a callable that returns the checked value or raises."""
    if isinstance(tp, type) or typing.get_origin(tp) is not None:
        checked = _check(value, tp, key)
        _check_range(checked, {"ge": 0}, key)
        return checked
    try:
        return tp(value)
    except ValueError as e:
        raise ParamsError(f"parameter {key!r}: {e}") from None


def read(path: str | Path = "params.yaml") -> dict[str, Any]:
    """The whole parameters file, validated: every section and top-level key, before any stage does work."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{path}: parameters file not found")
    try:
        doc = load_yaml(path)
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML ({e})") from None
    return validate(doc, path)


def load(cls: type[T], section: str, path: str | Path = "params.yaml") -> T:
    """Section ``section`` of the parameters file at ``path`` as dataclass ``cls``; the whole file is
    validated first."""
    value = read(path)[section]
    if dataclasses.is_dataclass(cls) and not isinstance(value, cls):
        raise ParamsError(f"section {section!r} is validated as {type(value).__name__}, not {cls.__name__}")
    return value


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
    """Write ``path`` with the overrides of ``preset`` applied, keeping its comments and layout (a round trip
    through ruamel.yaml, which DVC itself uses); the result is validated before it is written. Returns the
    merged parameters."""
    import io

    from ruamel.yaml import YAML

    from pipeline.io import write_text

    rt = YAML()
    rt.preserve_quotes = True
    rt.width = 110
    rt.representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    with Path(path).open() as f:
        doc = rt.load(f)
    overrides = load_yaml(preset) or {}
    if not isinstance(overrides, dict):
        raise ParamsError(f"{preset}: expected a mapping of overrides")

    def apply(node, changes, prefix=""):
        for key, value in changes.items():
            name = f"{prefix}.{key}" if prefix else key
            if key not in node:
                raise ParamsError(f"preset sets unknown parameter {name!r}")
            if isinstance(value, dict) and isinstance(node[key], dict) and node[key]:
                apply(node[key], value, name)
            else:
                node[key] = value

    apply(doc, overrides)
    merged = merge(load_yaml(path), overrides)
    validate(merged, path)
    out = io.StringIO()
    rt.dump(doc, out)
    write_text(path, out.getvalue())
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
