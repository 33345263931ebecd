"""The generation runtime on packed models (``python -m pipeline.runtime``, ``s3d8 generate``).

- :mod:`pipeline.runtime.generation`: loading a packed model and generating from it, the lean loop and Hugging
  Face's, and the command line.
- :mod:`pipeline.runtime.models`: the models it runs (our lean Llama over the packed tensors, the Hugging Face
  Llama and Mllama with native modules swapped in, the vision encoder).
- :mod:`pipeline.runtime.decode_step`: one decode token as one C call over the same weights and caches.
"""

from pipeline.moved import package_getattr

__getattr__ = package_getattr(__name__)
