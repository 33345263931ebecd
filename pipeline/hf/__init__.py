"""Packed models as Hugging Face model directories.

- :mod:`pipeline.hf.config`: the ``quantization_config`` a packed directory's ``config.json`` carries (no
  transformers import).
- :mod:`pipeline.hf.quantizer`: the quantizer registered with transformers, so that ``from_pretrained`` loads a
  packed directory with its weights kept packed (registered when ``pipeline`` and transformers are both imported:
  ``pipeline/__init__.py``).
- :mod:`pipeline.hf.write`: the directories written (config, processor, model card, shards) and saved again.

``python -m pipeline.hf card DIR --eval reports/eval.json`` writes a directory's model card with a run's scores.
"""

_API = frozenset(['KERNELS', 'PackedHfQuantizer', 'PackedQuantConfig', 'register', 'resolve_kernel'])


def __getattr__(name: str):
    """The names ``pipeline.hf`` held when it was one module (``pipeline.hf.quantizer`` now), imported on first use."""
    if name in _API:
        from pipeline.hf import quantizer
        return getattr(quantizer, name)
    raise AttributeError(f"module 'pipeline.hf' has no attribute {name!r}")
