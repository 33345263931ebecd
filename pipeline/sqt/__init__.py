"""The reference engine's ``.sqt`` file (SPEC section 9): ``python -m pipeline.sqt export|check``.

- :mod:`pipeline.sqt.container`: the container's constants and its one error type.
- :mod:`pipeline.sqt.blocks`: the JSON header's blocks (model config, tokenizer, vocabulary).
- :mod:`pipeline.sqt.write`: a packed S3D8 model exported.
- :mod:`pipeline.sqt.read`: a file read back and validated.
"""

_API = frozenset(['ENGINE_DTYPES', 'export', 'main', 'resolve_model', 'standard_name'])


def __getattr__(name: str):
    """The names ``pipeline.sqt`` held when it was one module (``pipeline.sqt.write`` now), imported on first use."""
    if name in _API:
        from pipeline.sqt import write
        return getattr(write, name)
    raise AttributeError(f"module 'pipeline.sqt' has no attribute {name!r}")
