"""The names of a packed Hugging Face directory: the guard ``model_type`` that makes plain transformers refuse it
loudly, the install hint, the weight-file names, the saved ``quantization_config``. The lowest floor of the
Hugging Face integration, below the writer (:mod:`pipeline.hf.write`) and the quantizer (:mod:`pipeline.hf.quantizer`);
it imports no transformers, so that importing it never runs the registration (``pipeline/__init__.py``) halfway."""

from __future__ import annotations

from pipeline import formats

GUARD_PREFIX = "s3d8-pipeline-"
BASE_MODEL_TYPES = ("mllama", "llama")
"""Base ``model_type``s a packed directory may have (each gets a registered guard type)."""
BASE_MODEL_TYPE = "mllama"
MODEL_TYPE = GUARD_PREFIX + BASE_MODEL_TYPE
"""``model_type`` of a packed Mllama directory's ``config.json``: unknown to plain transformers (a loud error
that names the package), read as ``mllama`` once ``pipeline`` is imported."""
HINT_KEY = "s3d8_pipeline"
INSTALL = "pip install <path to an s3d8-pipeline checkout or its wheel>"
HINT = (f"Packed weights: loading needs the s3d8-pipeline package ({INSTALL}; it is not on PyPI) and "
        f"`import pipeline` before from_pretrained. See README.md.")
"""``config.json``'s :data:`HINT_KEY`: what a user who opens the file after transformers refused it reads."""
QUANT_FORMAT = "quantization_config.format"
"""What an error about the packed format a directory's config names calls it."""
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MAX_SHARD_SIZE = 5 * 10**9
"""Bytes above which the packed weights are sharded (Llama 3.2 11B Vision in S3D8, about 3.6 GB, stays one
file, the reference's layout). Not a parameter in ``params.yaml``: it changes the layout, not a result."""


def guard_model_type(base: str) -> str:
    """The ``model_type`` a packed directory of a ``base`` model carries (``s3d8-pipeline-mllama``)."""
    return GUARD_PREFIX + base


def quant_method(fmt: str) -> str:
    """``quant_method`` of the format called ``fmt`` (S3D8: ``s3d8``; the others ``s3d8-pipeline-<name>``)."""
    return formats.get(fmt).quant_method


def saved_config(fmt: str, layout: str, version: str, bits_per_weight: float | None = None,
                 modules_to_not_convert: list[str] | None = None, formats: dict[str, str] | None = None) -> dict:
    """``quantization_config`` as ``config.json`` stores it: the file's description, never loading options.
    ``formats``: the precision plan's weights in another format than ``fmt`` (``{P.weight: format}``)."""
    saved = {"quant_method": quant_method(fmt), "format": fmt, "layout": layout, "version": version}
    if bits_per_weight is not None:
        saved["bits_per_weight"] = bits_per_weight
    if modules_to_not_convert is not None:
        saved["modules_to_not_convert"] = list(modules_to_not_convert)
    if formats:
        saved["formats"] = dict(sorted(formats.items()))
    return saved
