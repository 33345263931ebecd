"""The reference engine's ``.sqt`` file (SPEC section 9): ``python -m pipeline.sqt export|check``.

- :mod:`pipeline.sqt.container`: the container's constants and its one error type.
- :mod:`pipeline.sqt.blocks`: the JSON header's blocks (model config, tokenizer, vocabulary).
- :mod:`pipeline.sqt.write`: a packed S3D8 model exported.
- :mod:`pipeline.sqt.read`: a file read back and validated.
"""

from pipeline.moved import package_getattr

__getattr__ = package_getattr(__name__)
