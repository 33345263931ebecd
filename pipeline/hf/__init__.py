"""Packed models as Hugging Face model directories.

- :mod:`pipeline.hf.config`: the ``quantization_config`` a packed directory's ``config.json`` carries (no
  transformers import).
- :mod:`pipeline.hf.quantizer`: the quantizer registered with transformers, so that ``from_pretrained`` loads a
  packed directory with its weights kept packed (registered when ``pipeline`` and transformers are both imported:
  ``pipeline/__init__.py``).
- :mod:`pipeline.hf.write`: the directories written (config, processor, model card, shards) and saved again.

``python -m pipeline.hf card DIR --eval reports/eval.json`` writes a directory's model card with a run's scores.
"""

from pipeline.moved import package_getattr

__getattr__ = package_getattr(__name__)
