"""The packed file (SPEC section 7) and the modules that run it, in one home.

- :mod:`pipeline.packed.layout`: the S3D8 byte layout, declared once; it imports nothing of the project, so
  the formats and the native bindings below it can read it.
- :mod:`pipeline.packed.safetensors_io`: safetensors reading and streamed, atomic writing.
- :mod:`pipeline.packed.checkpoint`: a model directory's tensors, read lazily by name.
- :mod:`pipeline.packed.file`: the packed file written, its metadata read, a model rebuilt from it
  (``load_packed_model``, ``plan_packed``): the one reader of the packed file.
- :mod:`pipeline.packed.modules`: the modules that hold packed weights in a rebuilt model.

This ``__init__`` imports nothing: the formats import ``layout`` and ``safetensors_io`` while the file's reader
imports the formats.
"""

from pipeline.moved import package_getattr

__getattr__ = package_getattr(__name__)
