"""Synthetic models at real shapes, seeded weights written straight into their packed formats, for speed and memory
measurements without the real weights.

- :mod:`pipeline.synthetic.text`: Llama 3.2 1B- and 3B-class text decoders (``python -m pipeline.synthetic PRESET``),
  and their bf16 weights as GGUF for llama.cpp.
- :mod:`pipeline.synthetic.vision`: ``synthetic-11b-vision``, every tensor of Llama 3.2 11B Vision Instruct
  (``python -m pipeline.synthetic.vision``).
- :mod:`pipeline.synthetic.shape`: Llama 3.2 11B Vision's shape as data, the Mllama config at any depth.
"""

from pipeline.moved import package_getattr

__getattr__ = package_getattr(__name__)
