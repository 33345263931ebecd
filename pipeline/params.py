"""The whole ``params.yaml``: every top-level key and section validated with its schema before a stage does any
work (a typo in the QAT section fails the first stage, not the fifth), presets applied to it, and one section handed
to a stage (:func:`load`). A section's fields and checks: :mod:`pipeline.section`.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from pipeline.section import (PROJECT_PARAMS, ParamsError, bounded, check, check_range, defaults, from_dict, load_yaml,
                              non_negative, positive, probability)

__all__ = ["PROJECT_PARAMS", "ParamsError", "apply_preset", "bounded", "defaults", "from_dict", "load", "load_yaml",
           "merge", "non_negative", "positive", "probability", "read", "sections", "validate"]

T = TypeVar("T")


def sections() -> dict[str, Any]:
    """Every key of ``params.yaml`` and the schema that validates it: a dataclass, or a function that returns the
    checked value. Imported here, when a file is validated, not at the top: the schemas live beside the code that
    uses them, and a stage's results depend on its own section's values (its params deps in dvc.yaml), not on the
    other sections' schemas (``pipeline.depgraph.NOT_FOLLOWED`` says the same to the graph)."""
    from pipeline.teacher.answers import check_heldout
    from pipeline.bench import BenchParams
    from pipeline.cast.calibrate import CalibrateParams
    from pipeline.eval.suite import EvalParams
    from pipeline.cast.fit import FitParams
    from pipeline.formats import check_names
    from pipeline.launch.processes import LaunchParams
    from pipeline.cast.ptq import PackParams
    from pipeline.qat.train import QATParams
    from pipeline.teacher.sample import SampleParams
    from pipeline.teacher.generate_answers import GenerateParams
    from pipeline.teacher.source import TeacherParams
    from pipeline.toy.settings import ToyTeacherParams

    return {"toy_teacher": ToyTeacherParams, "teacher": TeacherParams, "formats": check_names,
            "heldout_prompts": check_heldout, "fit": FitParams, "sample": SampleParams, "generate": GenerateParams,
            "calibrate": CalibrateParams, "qat": QATParams, "pack": PackParams, "eval": EvalParams,
            "bench": BenchParams, "launch": LaunchParams, "cpu_numerics": check_cpu_numerics}


CPU_NUMERICS = ("portable", "native")


def check_cpu_numerics(value) -> str:
    """The ``cpu_numerics`` parameter (:mod:`pipeline.cpu_numerics`): portable or native."""
    if value not in CPU_NUMERICS:
        raise ValueError(f"expected portable or native, got {value!r}")
    return value


def validate(doc: Any, path: str | Path = "params.yaml") -> dict[str, Any]:
    """Check every top-level key and section of a parameters document; returns ``{section: value}``."""
    if not isinstance(doc, dict):
        raise ParamsError(f"{path}: expected a mapping of sections at the top level, got {type(doc).__name__}")
    schemas = sections()
    unknown = sorted(set(doc) - set(schemas))
    if unknown:
        raise ParamsError(f"{path}: unknown top-level key(s) {unknown}; known: {sorted(schemas)}")
    missing = sorted(set(schemas) - set(doc))
    if missing:
        raise ParamsError(f"{path}: missing section(s) {missing}")
    out = {}
    for section, value in doc.items():
        tp = schemas[section]
        out[section] = from_dict(tp, value, prefix=section) if dataclasses.is_dataclass(tp) else _check_value(tp, value, section)
    return out


def _check_value(tp: Any, value: Any, key: str) -> Any:
    """A top-level value: ``tp`` is a type, or a callable that returns the checked value or raises."""
    if isinstance(tp, type) or typing.get_origin(tp) is not None:
        checked = check(value, tp, key)
        check_range(checked, {"ge": 0}, key)
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

    from pipeline.files.atomic import write_text

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
