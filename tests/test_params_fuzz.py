"""Property-based: any mutation of the shipped params.yaml is either valid or a ParamsError naming a key, never
another exception (a traceback from deep inside a stage)."""

from __future__ import annotations

import copy
import os
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import params
from pipeline.params import ParamsError

SHIPPED = params.load_yaml(Path(__file__).resolve().parent.parent / "params.yaml")
EXAMPLES = int(os.environ.get("S3D8_FUZZ_EXAMPLES", "200"))


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, (*prefix, i))


PATHS = [p for p in _paths(SHIPPED) if p]
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(path=st.sampled_from(PATHS), value=VALUES, delete=st.booleans())
def test_a_mutated_params_file_is_valid_or_a_named_error(path, value, delete):
    doc = copy.deepcopy(SHIPPED)
    node = doc
    for part in path[:-1]:
        node = node[part]
    if delete and isinstance(node, dict):
        del node[path[-1]]
    else:
        node[path[-1]] = value
    try:
        params.validate(doc)
    except ParamsError as e:
        assert str(e), "an empty message"
