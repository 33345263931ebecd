"""The precision plan: which format each quantised weight is stored in.

A rule of ``pack.precision`` maps a regular expression to a format; a weight takes the format of the first rule
whose expression matches (``re.search``) its checkpoint name ``P`` (of ``P.weight``), else the stage's format (the
DVC matrix's). ``bf16`` keeps a weight unquantised (in ``pack.dtype``). A tied output head is one matrix with its
embedding, named by the embedding (``model.embed_tokens``): a rule for that name sets both.

    pack:
      precision:
        'embed_tokens$': int8           # the token embedding (and a tied lm_head) in per-row INT8
        'layers\\.(11|28)\\.mlp\\.down_proj$': int8

A packed file records the plan's outcome in its metadata (``formats``: ``{P.weight: format}`` for every weight not
in the file's ``format``), so readers never need the rules.
"""

from __future__ import annotations

import json
import re

from pipeline import formats
from pipeline.formats import FormatBase

KEEP = formats.BF16_BASELINE
"""The rules' name for a weight left unquantised."""


def check_rules(rules) -> dict[str, str]:
    """The ``pack.precision`` parameter: ``{regex: format}``, each a valid expression and a format with a packed
    layout (or ``bf16``)."""
    if not isinstance(rules, dict):
        raise ValueError(f"pack.precision: expected a mapping {{regex: format}}, got {rules!r}")
    for pattern, name in rules.items():
        try:
            re.compile(pattern)
        except (re.error, TypeError) as e:
            raise ValueError(f"pack.precision: {pattern!r} is not a regular expression ({e})") from None
        if name != KEEP:
            formats.packed(name, f"pack.precision[{pattern!r}]")
    return dict(rules)


def parse_rules(text: str) -> dict[str, str]:
    """Rules from the command line: ``PATTERN=FORMAT`` pairs separated by commas (``none``: no rule)."""
    if text.strip() in ("", "none"):
        return {}
    rules = {}
    for part in text.split(","):
        pattern, sep, name = part.strip().rpartition("=")
        if not sep or not pattern:
            raise ValueError(f"--precision: {part.strip()!r} is not PATTERN=FORMAT")
        rules[pattern] = name
    return check_rules(rules)


class Precision:
    """The plan of one model: :meth:`format_of` a weight name (``P``), ``None`` for a weight kept unquantised."""

    def __init__(self, default: FormatBase, rules: dict[str, str] | None = None) -> None:
        self.default = default
        self.rules = check_rules(rules or {})

    def format_of(self, name: str) -> FormatBase | None:
        for pattern, fmt in self.rules.items():
            if re.search(pattern, name):
                return None if fmt == KEEP else formats.packed(fmt)
        return self.default

    def assigned(self, names) -> dict[str, str]:
        """``{name: format name}`` of the ``names`` not in the default format (``bf16`` for kept ones)."""
        out = {}
        for n in names:
            fmt = self.format_of(n)
            if fmt is not self.default:
                out[n] = KEEP if fmt is None else fmt.name
        return out

    def describe(self) -> str:
        rules = ", ".join(f"{p} -> {f}" for p, f in self.rules.items())
        return f"{self.default.name}" + (f" ({rules})" if rules else "")


def file_formats(path, meta: dict[str, str], default: FormatBase) -> dict[str, FormatBase]:
    """``{P.weight: format}`` of a packed file's weights stored in another format than its ``format`` (metadata
    ``formats``); empty when it has none. Errors name the file."""
    raw = meta.get("formats")
    if raw is None:
        return {}
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{path}: metadata 'formats' is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: metadata 'formats' must be a JSON object {{weight: format}}")
    return {k: formats.packed(v, f"{path}: metadata 'formats' entry {str(k)[:80]!r}") for k, v in value.items()}
